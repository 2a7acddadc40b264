"""The log-prob mismatch tool: hand-computed statistics, and end to end on a tiny checkpoint.

One embedded server (scaled log-probs) serves every end-to-end test; the original-logprob test
starts a second one in that mode. The Megatron policy is built once in this process.
"""

import json
import math
from dataclasses import asdict

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_gspo.analysis.logprob_mismatch import (
    Comparison,
    MismatchConfig,
    MismatchReport,
    collect_rollouts,
    megatron_policy,
    mismatch_stats,
    run_mismatch,
    trainer_logprobs,
)
from megatron_gspo.analysis.mismatch_cli import by_length_tables, write_report
from megatron_gspo.cli import main as cli_main
from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.tasks import get_task
from megatron_gspo.tasks.tokenizer import build_char_tokenizer, encode_strict

TOKENIZER = build_char_tokenizer()
CFG = tiny(vocab_size=len(TOKENIZER), init_std=0.2)
NEW_TOKENS = 8
PNG = b"\x89PNG\r\n\x1a\n"


def test_stats_match_hand_computed_values():
    rollout = [
        torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64),
        torch.tensor([-0.3], dtype=torch.float64),
    ]
    log_r = [[0.5, 0.0, -0.1], [0.0002]]
    trainer = [o + torch.tensor(r, dtype=torch.float64) for o, r in zip(rollout, log_r)]
    s = mismatch_stats(rollout, trainer)
    assert s["num_sequences"] == 2 and s["num_tokens"] == 4
    assert s["abs_diff_mean"] == pytest.approx((0.5 + 0.0 + 0.1 + 0.0002) / 4)
    assert s["abs_diff_max"] == pytest.approx(0.5)
    assert s["first_token_abs_diff_mean"] == pytest.approx((0.5 + 0.0002) / 2)
    assert s["rest_abs_diff_mean"] == pytest.approx((0.0 + 0.1) / 2)
    assert s["per_position_abs_diff_mean"] == pytest.approx([(0.5 + 0.0002) / 2, 0.0, 0.1])
    assert s["per_position_count"] == [2, 1, 1]
    # exp(0.5) = 1.65 is outside [0.8, 1.27]; exp(-0.1) = 0.905 and the rest are inside.
    assert s["token_clip_fraction"] == pytest.approx(1 / 4)
    # Sequence log-ratios: 0.4 / 3 (outside [1 - 3e-4, 1 + 4e-4]) and 0.0002 (inside).
    assert s["log_seq_ratio_mean"] == pytest.approx((0.4 / 3 + 0.0002) / 2)
    assert s["seq_clip_fraction"] == pytest.approx(1 / 2)
    flat = [0.5, 0.0, -0.1, 0.0002]
    assert s["kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in flat) / 4)
    assert s["log_token_ratio_std"] == pytest.approx(torch.tensor(flat, dtype=torch.float64).std().item())
    # By length: the one-token response alone in bucket "1", the three-token one in "2-3".
    one, two_three = s["by_length"]
    assert (one["bucket"], one["num_sequences"], one["num_tokens"]) == ("1", 1, 1)
    assert one["abs_diff_mean"] == pytest.approx(0.0002)
    assert one["kl_k3"] == pytest.approx(math.exp(0.0002) - 1 - 0.0002)
    assert one["log_seq_ratio_mean"] == pytest.approx(0.0002)
    assert (two_three["bucket"], two_three["num_sequences"], two_three["num_tokens"]) == ("2-3", 1, 3)
    assert two_three["abs_diff_mean"] == pytest.approx(0.6 / 3)
    assert two_three["kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in flat[:3]) / 3)
    assert two_three["log_seq_ratio_mean"] == pytest.approx(0.4 / 3)


def test_report_prints_the_by_length_table(tmp_path):
    # Lengths 1, 2, 5: buckets "1", "2-3", "4-7"; |diff| 0.1, 0.2, 0.3 on every token.
    rollout = [torch.full((n,), -1.0) for n in (1, 2, 5)]
    trainer = [r + d for r, d in zip(rollout, (0.1, -0.2, 0.3))]
    report = MismatchReport(
        asdict(MismatchConfig("ckpt")), [Comparison("scaled", 1.0, 1.0, rollout, trainer)]
    )
    summary = write_report(report, tmp_path)
    table = by_length_tables(summary)
    assert table[0] == "### scaled T=1 / trainer T=1: by response length"
    assert table[4:7] == [
        "| 1 | 1 | 1 | 0.1 | 0.00517 | 0.1 |",
        "| 2-3 | 1 | 2 | 0.2 | 0.0187 | -0.2 |",
        "| 4-7 | 1 | 5 | 0.3 | 0.0499 | 0.3 |",
    ]
    assert "\n".join(table) in (tmp_path / "summary.md").read_text()


def test_stats_and_config_reject_bad_input():
    with pytest.raises(ValueError, match="response 0"):
        mismatch_stats([torch.zeros(3)], [torch.zeros(2)])
    with pytest.raises(ValueError, match="same non-zero number"):
        mismatch_stats([], [])
    with pytest.raises(ValueError, match="original_server_url"):
        MismatchConfig("ckpt", server_url="http://x", original_logprob=True)
    with pytest.raises(ValueError, match="trainer_temperature"):
        MismatchConfig("ckpt", trainer_temperature=0.0)
    with pytest.raises(ValueError, match="temperatures"):
        MismatchConfig("ckpt", temperatures=())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("mismatch") / "ckpt", CFG, seed=0)


@pytest.fixture(scope="module")
def server_url(checkpoint):
    with launch_embedded_server(checkpoint) as server:
        yield server.url


@pytest.fixture(scope="module")
def model(checkpoint):
    with megatron_policy(checkpoint) as gpt:
        yield gpt


@pytest.fixture(scope="module")
def prompts():
    return [
        [TOKENIZER.bos_token_id] + encode_strict(TOKENIZER, p.prompt) for p in get_task("addition").heldout(6)
    ]


def _config(checkpoint, url, **changes):
    options = dict(temperatures=(1.0, 0.7), server_url=url, max_new_tokens=NEW_TOKENS, samples_per_prompt=2)
    return MismatchConfig(str(checkpoint), ignore_eos=True, **{**options, **changes})


@pytest.mark.slow  # a real server and model: ~30 s for the module on a shared box
def test_report_files_and_small_mismatch(checkpoint, server_url, model, prompts, tmp_path):
    report = run_mismatch(_config(checkpoint, server_url), prompts, model=model)
    summary = write_report(report, tmp_path)
    for png in ("mismatch_per_position.png", "ratio_spread.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert "| scaled T=0.7 / trainer T=0.7 |" in (tmp_path / "summary.md").read_text()
    rows = summary["comparisons"]
    assert [(r["temperature"], r["trainer_temperature"]) for r in rows] == [(1.0, 1.0), (0.7, 0.7)]
    n = len(prompts) * 2
    for r in rows:
        assert r["num_sequences"] == n and r["num_tokens"] == n * NEW_TOKENS
        assert r["per_position_count"] == [n] * NEW_TOKENS
        # Same weights, fp32 on both engines: only float rounding separates them.
        assert r["abs_diff_max"] <= 1e-4, r
        assert r["token_clip_fraction"] == 0.0 and r["kl_k3"] < 1e-8
        print(f"{r['name']}: max {r['abs_diff_max']:.2e} mean {r['abs_diff_mean']:.2e} "
              f"first {r['first_token_abs_diff_mean']:.2e} rest {r['rest_abs_diff_mean']:.2e}")  # fmt: skip


@pytest.mark.slow  # a real server and model: ~30 s for the module on a shared box
def test_trainer_side_matches_transformers_at_each_temperature(checkpoint, server_url, model, prompts):
    """An independent reference for the trainer side: HF log_softmax(logits / T) of the same tokens."""
    with SGLangClient([server_url]) as client:
        sample = collect_rollouts(client, prompts[:1], temperature=0.7, cfg=_config(checkpoint, server_url))[
            0
        ]
    assert sample.response_length == NEW_TOKENS
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.cat([sample.prompt_ids, sample.response_ids])[None]).logits[0].double()
    for t in (0.7, 0.5):
        ours = trainer_logprobs(model, [sample], temperature=t)[0]
        torch.testing.assert_close(ours.double(), _hf_logprobs(logits, sample, t), atol=1e-4, rtol=0)
    # The server reported the T = 0.7 log-probs of the tokens it sampled.
    torch.testing.assert_close(
        sample.rollout_logprobs.double(), _hf_logprobs(logits, sample, 0.7), atol=1e-4, rtol=0
    )


def _hf_logprobs(logits, sample, temperature):
    """[R] log_softmax(logits / T) of the response tokens; `logits` [P + R, V] of the full sequence."""
    p = sample.prompt_length
    logp = torch.log_softmax(logits / temperature, -1)[p - 1 : -1]
    return logp.gather(-1, sample.response_ids[:, None])[:, 0]


@pytest.mark.slow  # a real server and model: ~30 s for the module on a shared box
def test_control_trainer_at_another_temperature_shows_mismatch(checkpoint, server_url, model, prompts):
    matched = run_mismatch(_config(checkpoint, server_url, temperatures=(1.0,)), prompts, model=model)
    control = run_mismatch(
        _config(checkpoint, server_url, temperatures=(1.0,), trainer_temperature=0.5), prompts, model=model
    )
    good, bad = matched.summary()["comparisons"][0], control.summary()["comparisons"][0]
    assert bad["abs_diff_mean"] > 1e-2 and bad["abs_diff_mean"] > 1e3 * good["abs_diff_mean"]
    assert bad["token_clip_fraction"] > 0.1 and bad["seq_clip_fraction"] > 0.5
    # Averaging over a response cancels part of the token noise: the sequence ratio spreads less.
    assert bad["log_seq_ratio_std"] < bad["log_token_ratio_std"]


@pytest.mark.slow  # a real server and model: ~30 s for the module on a shared box
def test_original_logprob_mode(checkpoint, server_url, model, prompts):
    with launch_embedded_server(checkpoint, extra_args=["--return-original-logprob"]) as original:
        cfg = _config(checkpoint, server_url, original_logprob=True, original_server_url=original.url)
        summary = run_mismatch(cfg, prompts[:3], model=model).summary()
    rows = {r["name"]: r for r in summary["comparisons"]}
    assert set(rows) == {
        "scaled T=1 / trainer T=1",
        "scaled T=0.7 / trainer T=0.7",
        "original T=1 / trainer T=1",
        "original T=0.7 / trainer T=1",
        "original T=0.7 / trainer T=0.7",
    }
    # Raw log-probs match a trainer at T = 1; a trainer that divides by T = 0.7 does not.
    assert rows["original T=0.7 / trainer T=1"]["abs_diff_max"] <= 1e-4
    assert rows["original T=0.7 / trainer T=0.7"]["abs_diff_mean"] > 1e-2
    # The mode changes only what is reported, not what is sampled (same seeds, same tokens).
    gap = summary["mode_gap"]
    assert gap["0.7"]["same_tokens_fraction"] == 1.0 and gap["1"]["same_tokens_fraction"] == 1.0
    assert gap["1"]["abs_diff_max"] <= 1e-4 < gap["0.7"]["abs_diff_max"]


@pytest.mark.slow  # a real server and model: ~30 s for the module on a shared box
def test_cli_with_a_prompt_file(checkpoint, server_url, model, prompts, tmp_path, capsys):
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("\n".join([json.dumps(prompts[0]), json.dumps({"input_ids": prompts[1]})]) + "\n")
    out = tmp_path / "report"
    argv = [
        "mismatch",
        "--checkpoint",
        str(checkpoint),
        "--server-url",
        server_url,
        "--prompts",
        str(prompt_file),
    ]
    argv += ["--temperatures", "0.8", "--max-new-tokens", "4", "--ignore-eos", "--out", str(out)]
    assert cli_main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["comparisons"][0]["num_tokens"] == 2 * 4
    assert summary["comparisons"][0]["abs_diff_max"] <= 1e-4
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": []}\n')
    assert cli_main([*argv[:5], "--prompts", str(bad), "--out", str(out)]) == 2
    assert f"--prompts {bad} line 1: expected text, token ids or chat messages" in capsys.readouterr().err
