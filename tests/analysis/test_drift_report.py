"""The drift tool end to end on a tiny checkpoint and a perturbed copy, and on a rollout dump."""

import json
import subprocess

import pytest
import torch
from warm_python import python

from megatron_gspo.analysis.drift_report import Sample, compare, load_dump, load_hf, save_dump, teacher_forced
from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import load_hf_state_dict, make_tiny_hf_checkpoint, save_hf_state_dict
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
CFG = tiny(vocab_size=len(TOKENIZER), init_std=0.2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("drift")
    a = make_tiny_hf_checkpoint(root / "a", CFG, seed=0)
    state = load_hf_state_dict(a)
    gen = torch.Generator().manual_seed(1)
    perturbed = {
        k: v + 0.3 * torch.randn(v.shape, generator=gen) if k.endswith("mlp.gate.weight") else v
        for k, v in state.items()
    }
    b = save_hf_state_dict(root / "b", perturbed, CFG, TOKENIZER)
    return a, b


@pytest.mark.slow  # the drift CLI end to end: ~20 s on a shared box
def test_cli_makes_pngs_and_summary(checkpoints, tmp_path):
    a, b = checkpoints
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "\n".join(
            json.dumps({"step": s, "drift/old_new/mean": 0.01 * s, "drift/old_new/tokens_changed": 0.02 * s})
            for s in range(1, 5)
        )  # fmt: skip
    )
    out = tmp_path / "report"
    cmd = [*python(), "-m", "megatron_gspo.cli", "drift", "--a", str(a), "--b", str(b)]
    cmd += ["--num-prompts", "6", "--max-new-tokens", "8", "--metrics", str(metrics), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for png in ("drift_per_layer.png", "ratio_spread.png", "drift_over_steps.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["figures"] == ["drift_per_layer.png", "ratio_spread.png", "drift_over_steps.png"]
    assert len(summary["drift_per_layer"]) == CFG.num_layers
    assert 0 < summary["drift_mean"] < 1  # perturbed routers: some, not all, experts change
    assert summary["tokens_changed_any_layer"] >= max(summary["drift_per_layer"])
    # The length-normalised sequence ratio spreads less than the per-token ratio.
    assert summary["log_seq_ratio_std"] < summary["log_token_ratio_std"]
    assert "| layer | drift |" in (out / "summary.md").read_text()


def test_dump_round_trip_and_dump_vs_checkpoint(checkpoints, tmp_path):
    a, b = checkpoints
    model_a, model_b = load_hf(a), load_hf(b)
    tokens = [torch.tensor(TOKENIZER.encode(t)) for t in ("12+34=46", "7+8=15", "99+1=100")]
    # A dump recorded by model b, read back and compared with checkpoint a, equals a-vs-b directly.
    samples = [Sample(t, 4, teacher_forced(model_b, t)[0]) for t in tokens]
    save_dump(tmp_path / "d.jsonl", samples)
    back = load_dump(tmp_path / "d.jsonl")
    assert all(torch.equal(x.routed_experts, y.routed_experts) for x, y in zip(back, samples))
    from_dump = compare(model_a, back).summary()
    direct = compare(model_a, [Sample(t, 4) for t in tokens], model_b=model_b).summary()
    assert from_dump["drift_per_layer"] == pytest.approx(direct["drift_per_layer"])
    same = compare(model_a, [Sample(t, 4, teacher_forced(model_a, t)[0]) for t in tokens]).summary()
    assert same["drift_mean"] == 0.0
    (tmp_path / "bad.jsonl").write_text(json.dumps({"tokens": [1, 2, 3], "prompt_length": 1,
                                                    "routed_experts": [[[0, 1]]]}))  # fmt: skip
    with pytest.raises(ValueError, match=r"bad.jsonl:1: routed_experts shape \(1, 1, 2\), expected \[T-1=2"):
        load_dump(tmp_path / "bad.jsonl")


@pytest.mark.parametrize(
    "other, named",
    [
        (dict(num_experts=16), "num_experts 8 vs 16"),
        (dict(num_layers=3), "num_hidden_layers 2 vs 3"),
    ],
)
def test_checkpoints_that_route_differently_are_refused_in_one_line(
    checkpoints, tmp_path, capsys, other, named
):
    """Not a full report of drift between unrelated experts, nor a shape ValueError traceback."""
    from megatron_gspo.cli import main as cli

    a, _ = checkpoints
    b = make_tiny_hf_checkpoint(tmp_path / "b", CFG.replace(**other), seed=0)
    out = tmp_path / "report"
    assert cli(["drift", "--a", str(a), "--b", str(b), "--num-prompts", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "config error: drift --a" in err and named in err and "Traceback" not in err
    assert not out.exists()


def test_a_file_that_is_not_a_dump_is_refused_in_one_line(checkpoints, tmp_path, capsys):
    from megatron_gspo.cli import main as cli

    a, _ = checkpoints
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "actor/pg_loss": 0.1}) + "\n{truncated\n")
    assert cli(["drift", "--a", str(a), "--dump", str(metrics), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"--dump: {metrics}:1: a dump line needs 'tokens' and 'prompt_length'" in err
    metrics.write_text("{truncated\n")
    assert cli(["drift", "--a", str(a), "--dump", str(metrics), "--out", str(tmp_path / "r")]) == 2
    assert f"{metrics}:1: not a JSON line" in capsys.readouterr().err
