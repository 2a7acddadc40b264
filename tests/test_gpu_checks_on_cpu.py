"""The GPU smoke checks' bodies (tests/gpu/gpu_checks.py) run on CPU with the local spec (fp32; the
build, packing and HF checks in bf16 too, megatron's mixed precision on CPU, at the bf16 bounds).

The GPU suite runs only where a GPU exists; this keeps its code in step with the package on
every CPU run, and shows that its bf16 tolerances still catch the defects they are for: a
packing leak between samples and a gate/up mix-up in the HF conversion. The RL run and
parity bodies are covered by tests/training/test_train_cli.py and tests/model/test_parity_cli.py.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
import gpu_checks as checks  # noqa: E402

from megatron_gspo.model.engine import EngineConfig  # noqa: E402

CPU = EngineConfig(dtype="fp32", use_te=False)
CPU_BF16 = EngineConfig(dtype="bf16", use_te=False)  # megatron's mixed precision runs on CPU too


def test_world_of_one():
    assert "gloo on cpu" in checks.check_world_of_one()


@pytest.mark.parametrize("engine", [CPU, CPU_BF16], ids=["fp32", "bf16"])
def test_build(engine):
    assert "layout mask" in checks.check_build(checks.tiny_model(), engine, expect_te=False)


@pytest.mark.parametrize("engine", [CPU, CPU_BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["mask", "thd"])
def test_packed_equals_per_row(layout, engine):
    checks.check_packed_equals_per_row(checks.tiny_model(), engine, layout=layout, te=False)


def test_packed_check_catches_a_leak_at_bf16_tolerance(monkeypatch):
    """Samples seeing their row neighbours (a causal mask over the whole row) fail the bf16 bound."""
    import megatron_gspo.model.logprobs as logprobs

    def row_causal(packed, device):
        R, L = packed.tokens.shape
        return torch.ones(L, L, dtype=torch.bool, device=device).triu(1).expand(R, 1, L, L)

    monkeypatch.setattr(logprobs, "block_causal_mask", row_causal)
    monkeypatch.setattr(checks, "PACKED_FP32_TOL", checks.PACKED_BF16_TOL)
    with pytest.raises(AssertionError, match="max.d logprob"):
        checks.check_packed_equals_per_row(checks.tiny_model(), CPU, layout="mask", te=False)


@pytest.mark.parametrize("engine", [CPU, CPU_BF16], ids=["fp32", "bf16"])
def test_hf_roundtrip(tmp_path, engine):
    assert "exact" in checks.check_hf_roundtrip(tmp_path, checks.tiny_model(), engine, te=False)


def test_hf_check_catches_gate_up_swapped_at_bf16_tolerance(tmp_path, monkeypatch):
    """A conversion that swaps fc1's halves both ways round-trips exactly; the log-probs catch it."""
    import megatron_gspo.model.hf.convert as convert

    merge, split = convert._merge, convert._split

    def swapped_merge(mapping, parts, cfg):
        return merge(mapping, parts[::-1] if mapping.kind == "fc1" else parts, cfg)

    def swapped_split(mapping, tensor, cfg):
        parts = split(mapping, tensor, cfg)
        return parts[::-1] if mapping.kind == "fc1" else parts

    monkeypatch.setattr(convert, "_merge", swapped_merge)
    monkeypatch.setattr(convert, "_split", swapped_split)
    monkeypatch.setattr(checks, "HF_FP32_TOL", checks.HF_BF16_TOL)
    with pytest.raises(AssertionError, match="log-probs vs transformers"):
        checks.check_hf_roundtrip(tmp_path, checks.tiny_model(), CPU, te=False)


def test_memory_workload_and_plan_estimate():
    model_cfg = checks.memory_model(
        vocab_size=256, hidden_size=64, head_dim=16, moe_ffn_hidden_size=32, max_position_embeddings=64
    )
    estimate = checks.plan_estimate(model_cfg, CPU, samples=2, seq_len=64, flash_attention=False)
    assert estimate.model_states > 0 and estimate.activation > 0
    assert torch.isfinite(torch.tensor(checks.memory_workload(model_cfg, CPU, samples=2, seq_len=64)))


def test_memory_verdict_holds_the_margin_the_plan_relies_on():
    estimate = checks.MemoryEstimate(model_states=6 * 2**30, activation=2 * 2**30)
    assert "= 1.05x" in checks.memory_verdict(int(1.05 * estimate.total), estimate)
    for ratio in (0.8, 1.08):  # a plan 8% low would pass a 235B layout that runs out of memory
        with pytest.raises(AssertionError, match=f"= {ratio:.2f}x"):
            checks.memory_verdict(int(ratio * estimate.total), estimate)
