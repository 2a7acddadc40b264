"""Checkpoints as transformers 5.x saves them: read through one mapping, implemented or refused by name.

Each checkpoint is built and saved by transformers' own `Qwen3MoeConfig` / `Qwen3MoeForCausalLM`
(`save_pretrained` writes `num_local_experts` and `rope_parameters`); the reference is HF's
forward on the saved directory.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from warm_python import python

from megatron_gspo.cli import main as cli
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import qwen3_30b_a3b
from megatron_gspo.model.distributed import ParallelConfig, init_distributed
from megatron_gspo.model.hf.checkpoint import load_hf_state_dict
from megatron_gspo.model.hf.config import (
    HFConfigError,
    UnsupportedArchitectureError,
    from_hf_config,
    to_hf_config,
)
from megatron_gspo.model.hf.convert import (
    hf_to_megatron,
    hf_token_logprobs,
    load_hf_checkpoint,
    logprob_diff,
    random_tokens,
    read_hf_config,
)
from megatron_gspo.model.hf.convert import main as convert_main
from megatron_gspo.model.hf.export import export_hf_checkpoint
from megatron_gspo.model.sharding import load_global_state_dict

TOLERANCE = 1e-5
VOCAB = 49
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    max_position_embeddings=64,
    norm_topk_prob=True,
    initializer_range=0.2,  # sharp logits and routing: mistakes show
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10_000.0}
CASES = {
    "default": {},
    "float_rope_theta": {"rope_parameters": {"rope_type": "default", "rope_theta": 1234.5678}},
    "yarn": {"rope_parameters": YARN},
    "yarn_all_knobs": {
        "rope_parameters": YARN
        | {"factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5}
        | {"truncate": False, "rope_theta": 5000.25}
    },
    "top1_norm_topk_prob": {"num_experts_per_tok": 1},
    "top1_no_norm": {"num_experts_per_tok": 1, "norm_topk_prob": False},
    "tied_no_norm": {"tie_word_embeddings": True, "norm_topk_prob": False},
}


def save_hf(path, seed=0, **changes):
    """A random tiny Qwen3-MoE saved by transformers itself; RMSNorm gains random too."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**(BASE | changes))).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.copy_(1.0 + 0.3 * torch.randn(tensor.shape))
    model.save_pretrained(path)
    return path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def world_of_one():
    init_distributed(ParallelConfig(), seed=3)


def _diff(model, path, length=60):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return logprob_diff(model, lambda t: hf_token_logprobs(hf, t), random_tokens(VOCAB, 3, length, seed=2))


@pytest.mark.parametrize("case", list(CASES))
def test_transformers5_checkpoint_loads_and_matches_hf(world_of_one, tmp_path, case):
    path = save_hf(tmp_path / case, seed=1, **CASES[case])
    saved = json.loads((path / "config.json").read_text())
    assert "num_local_experts" in saved and "num_experts" not in saved and "rope_parameters" in saved
    cfg = read_hf_config(path)
    model = build_model(cfg, ParallelConfig()).eval()
    load_hf_checkpoint(model, path)
    worst, mean = _diff(model, path)  # 60 tokens: past YaRN's original 16 positions
    print(f"{case}: per-token |dlogprob| max={worst:.2e} mean={mean:.2e}")
    assert worst <= TOLERANCE
    # Export describes the model trained: same tensors, and HF reads the same model from it.
    out = export_hf_checkpoint(model, tmp_path / "export", cfg)
    assert read_hf_config(out) == cfg
    original, written = load_hf_state_dict(path), load_hf_state_dict(out)
    assert written.keys() == original.keys() and all(torch.equal(written[k], original[k]) for k in original)
    tokens = random_tokens(VOCAB, 2, 60, seed=4)
    a = hf_token_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tokens)
    b = hf_token_logprobs(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), tokens)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("case", "wrong", "at_least"),
    [
        ("yarn", {"rope_type": "default"}, 1e-2),  # YaRN read as plain RoPE (what was loaded before)
        ("float_rope_theta", {"rope_theta": 1234.0}, 10 * TOLERANCE),  # the base truncated to an int
    ],
)
def test_the_comparison_sees_rope_mistakes(world_of_one, tmp_path, case, wrong, at_least):
    path = save_hf(tmp_path / case, seed=1, **CASES[case])
    cfg = read_hf_config(path)
    model = build_model(cfg.replace(**wrong), ParallelConfig()).eval()
    load_global_state_dict(model, hf_to_megatron(load_hf_state_dict(path), cfg))
    worst, _ = _diff(model, path)
    print(f"negative control {case} as {wrong}: max |dlogprob| {worst:.2e}")
    assert worst > at_least


def test_transformers4_names_read_the_same(tmp_path):
    path = save_hf(tmp_path / "v5", **CASES["yarn"])
    expected = read_hf_config(path)
    old = json.loads((path / "config.json").read_text())
    old["num_experts"] = old.pop("num_local_experts")
    rope = old.pop("rope_parameters")
    old["rope_theta"] = rope.pop("rope_theta")
    old["rope_scaling"] = {"type": rope.pop("rope_type")} | rope
    (path / "config.json").write_text(json.dumps(old))
    assert read_hf_config(path) == expected


# Qwen3-30B-A3B's config.json as released (transformers 4.51 names).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_released_qwen3_30b_a3b_config_is_the_preset():
    assert from_hf_config(QWEN3_30B_A3B) == qwen3_30b_a3b()
    # Qwen's long-context recipe: YaRN x4 from 32k.
    long = from_hf_config(
        QWEN3_30B_A3B
        | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    )
    assert long == qwen3_30b_a3b(
        rope_type="yarn", yarn_factor=4.0, yarn_original_max_position_embeddings=32768
    )
    assert from_hf_config(to_hf_config(long)) == long


REFUSED = {
    "sliding-window attention": {"use_sliding_window": True, "sliding_window": 8},
    "non-SiLU activation": {"hidden_act": "gelu"},
    "attention bias": {"attention_bias": True},
    "dense layers mixed in": {"mlp_only_layers": [1]},
    "dense layers mixed in ": {"decoder_sparse_step": 2},
    "RoPE scaling 'linear'": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
    "RoPE scaling 'dynamic'": {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
    "attention dropout": {"attention_dropout": 0.1},
}


def _plan(tmp_path, hf_dir, capsys, command=("plan", "--world-size", "1")):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{hf_path: {hf_dir}}}\ntrainer: {{run_dir: {tmp_path / 'run'}}}\n")
    capsys.readouterr()  # what saving the checkpoint printed
    code = cli([command[0], "--config", str(config), *command[1:]])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("feature", list(REFUSED))
def test_unsupported_architecture_is_refused_by_name_at_load_and_in_plan(
    world_of_one, tmp_path, capsys, feature
):
    path = save_hf(tmp_path / "ckpt", **REFUSED[feature])
    name = feature.strip()
    with pytest.raises(UnsupportedArchitectureError, match=f"unsupported architecture: {name}"):
        read_hf_config(path)
    model = build_model(read_hf_config(save_hf(tmp_path / "good")), ParallelConfig())
    with pytest.raises(UnsupportedArchitectureError, match=name):
        load_hf_checkpoint(model, path)
    for command in (("plan", "--world-size", "1"), ("train",)):  # train: refused before anything starts
        code, err = _plan(tmp_path, path, capsys, command)
        assert code == 2 and name in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
    assert convert_main(["--hf", str(path), "--check"]) == 2  # the conversion check: the same line
    err = capsys.readouterr().err
    assert err.startswith("convert --check: ") and name in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("feature", "changes"),
    [
        ("non-SiLU activation", {"hidden_act": "gelu"}),
        ("sliding window", REFUSED["sliding-window attention"]),
    ],
)
def test_refused_features_change_hf_forward(tmp_path, feature, changes):
    """What is refused is not cosmetic: HF's own forward on the same weights moves."""
    base = Qwen3MoeForCausalLM.from_pretrained(save_hf(tmp_path / "base", seed=2), dtype=torch.float32).eval()
    other = Qwen3MoeForCausalLM(Qwen3MoeConfig(**(BASE | changes))).eval()
    other.load_state_dict(base.state_dict())
    tokens = random_tokens(VOCAB, 2, 40, seed=5)
    moved = (hf_token_logprobs(base, tokens) - hf_token_logprobs(other, tokens)).abs().max().item()
    print(f"{feature}: HF log-probs move by {moved:.2e}")
    assert moved > 1e-2


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_local_experts": None}, "missing key 'num_local_experts' or 'num_experts'"),
        ({"hidden_size": "32"}, "hidden_size='32' must be an integer >= 1"),
        ({"num_key_value_heads": 0}, "num_key_value_heads=0 must be an integer >= 1"),
        ({"rms_norm_eps": True}, "rms_norm_eps=True must be a finite number"),
        ({"num_experts_per_tok": 9}, "moe_topk=9 must be in"),
        ({"num_experts": 8}, "num_local_experts=4 and num_experts=8 disagree"),
        ({"rope_parameters": "yarn"}, "rope_parameters='yarn' must be an object"),
    ],
)
def test_config_reading_errors_are_one_named_line(tmp_path, capsys, changes, message):
    path = edit_config(save_hf(tmp_path / "ckpt"), **changes)
    with pytest.raises(HFConfigError, match=message.replace("(", r"\(")):
        read_hf_config(path)
    code, err = _plan(tmp_path, path, capsys)
    assert code == 2 and message in err and str(path / "config.json") in err
    assert len(err.strip().splitlines()) == 1, err


def test_unreadable_config_json_is_named(tmp_path, capsys):
    path = save_hf(tmp_path / "ckpt")
    (path / "config.json").write_text("{not json")
    code, err = _plan(tmp_path, path, capsys)
    assert code == 2 and "not readable JSON" in err and "Traceback" not in err


@pytest.mark.slow
def test_checkpoint_tensors_not_matching_config_are_one_line_at_train_startup(tmp_path):
    """config.json readable, a tensor mis-shaped: found after distributed start-up, still exit 2 and named."""
    import os
    import subprocess

    from megatron_gspo.model.config import tiny
    from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint

    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", tiny(vocab_size=80))
    edit_config(path, moe_intermediate_size=16)  # the expert tensors are 32 wide
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{hf_path: {path}}}\ntrainer: {{run_dir: {tmp_path / 'run'}}}\n")
    result = subprocess.run(
        [*python(), "-m", "megatron_gspo.cli", "train", "--config", str(config)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "model.hf_path:" in result.stderr and "gate_proj.weight" in result.stderr, result.stderr[-3000:]
