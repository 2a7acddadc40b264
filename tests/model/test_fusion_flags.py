"""The fused-kernel decision table (model/engine.py), with the machine's facts passed explicitly."""

import dataclasses
import itertools

import pytest

from megatron_gspo.model.builder import transformer_config
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig
from megatron_gspo.model.engine import EngineConfig, KernelAvailability, fused_flags

MACHINES = [KernelAvailability(*facts) for facts in itertools.product([False, True], repeat=3)]
TE_FLAGS = ("moe_grouped_gemm", "moe_permute_fusion", "apply_rope_fusion")
NEVER = ("masked_softmax_fusion", "persist_layer_norm", "cross_entropy_loss_fusion")


def machine(cuda=False, te=False, apex=False):
    return KernelAvailability(cuda=cuda, te=te, apex_grad_accum=apex)


# Default engine (use_te / fused_kernels unset): (cuda, te, apex) -> flags that are on.
DEFAULT_TABLE = {
    (False, False, False): set(),
    (False, True, False): set(),
    (False, False, True): set(),
    (False, True, True): set(),
    (True, False, False): set(),  # no TE: local spec, fused_kernels follows use_te -> off
    (True, False, True): set(),
    (True, True, False): {*TE_FLAGS, "bias_activation_fusion", "bias_dropout_fusion"},
    (True, True, True): {
        *TE_FLAGS,
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "gradient_accumulation_fusion",
    },
}


@pytest.mark.parametrize("facts", sorted(DEFAULT_TABLE))
def test_default_engine_table(facts):
    flags = fused_flags(EngineConfig(), machine(*facts))
    assert {name for name, on in flags.items() if on} == DEFAULT_TABLE[facts]


def test_explicit_settings_on_every_machine():
    """Every (use_te, fused_kernels, router_fusion) on every machine: on, off, or a named refusal."""
    for available, use_te, fused, router in itertools.product(
        MACHINES, [None, False, True], [None, False, True], [False, True]
    ):
        try:
            engine = EngineConfig(use_te=use_te, fused_kernels=fused, router_fusion=router)
        except ValueError:  # fused_kernels / router_fusion with use_te=false: refused at load
            assert use_te is False and (fused or router)
            continue
        te_spec = available.cuda and available.te and use_te is not False
        try:
            flags = fused_flags(engine, available)
        except ValueError as err:
            asked = use_te is True or fused is True or router
            assert asked and not te_spec, (available, engine)
            assert "needs" in str(err)
            continue
        want_fused = te_spec and fused is not False
        assert all(flags[name] == want_fused for name in TE_FLAGS), (available, engine, flags)
        assert flags["gradient_accumulation_fusion"] == (want_fused and available.apex_grad_accum)
        assert flags["bias_activation_fusion"] == flags["bias_dropout_fusion"] == want_fused
        assert flags["moe_router_fusion"] == router
        assert not any(flags[name] for name in NEVER)
        if not available.cuda:
            assert not any(flags.values())


def test_gpu_without_apex_keeps_te_fusions_but_not_grad_accum_fusion():
    flags = fused_flags(EngineConfig(use_te=True, fused_kernels=True), machine(cuda=True, te=True))
    assert flags["moe_grouped_gemm"] and flags["apply_rope_fusion"]
    assert not flags["gradient_accumulation_fusion"]


def test_refusals_name_what_is_missing():
    with pytest.raises(ValueError, match="use_te=true needs CUDA"):
        fused_flags(EngineConfig(use_te=True), machine(te=True))
    with pytest.raises(ValueError, match="transformer_engine"):
        fused_flags(EngineConfig(use_te=True), machine(cuda=True))
    with pytest.raises(ValueError, match="fused_kernels needs"):
        fused_flags(EngineConfig(fused_kernels=True), machine(cuda=True, apex=True))
    with pytest.raises(ValueError, match="router_fusion needs"):
        fused_flags(EngineConfig(router_fusion=True), machine(cuda=True))


def test_megatron_accepts_the_gpu_decision_for_this_architecture():
    """Megatron's TransformerConfig checks accept the H100 flags (TE ones aside: TE is absent here)."""
    config = transformer_config(tiny(), ParallelConfig(), EngineConfig(), available=machine())
    assert not any(getattr(config, name) for name in fused_flags(EngineConfig(), machine()))
    gpu = fused_flags(EngineConfig(), machine(cuda=True, te=True, apex=True))
    rest = {name: on for name, on in gpu.items() if name not in TE_FLAGS}
    assert rest["bias_activation_fusion"] and rest["gradient_accumulation_fusion"]
    checked = dataclasses.replace(config, **rest)  # runs TransformerConfig.__post_init__ again
    assert checked.bias_activation_fusion and checked.activation_func is config.activation_func


def test_te_flags_really_need_te():
    """Negative control: claiming TE on this machine (which has none) makes megatron refuse RoPE fusion."""
    from megatron_gspo.patches import transformer_engine_available

    if transformer_engine_available():
        pytest.skip("TransformerEngine is installed here")
    claimed = machine(cuda=True, te=True)
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        transformer_config(tiny(), ParallelConfig(), EngineConfig(), available=claimed)


def test_grad_accum_fusion_really_needs_apex():
    """Negative control: megatron's ColumnParallelLinear (the output layer) refuses it without apex."""
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        pytest.skip("apex's fused_weight_gradient_mlp_cuda is installed here")
    from megatron_gspo.model.distributed import init_distributed

    init_distributed(ParallelConfig(), seed=1)
    config = transformer_config(tiny(), ParallelConfig(), EngineConfig(), available=machine())
    config.gradient_accumulation_fusion = True
    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
        layers.ColumnParallelLinear(8, 8, config=config, init_method=lambda w: w, bias=False)


def test_the_gpu_extra_requires_the_te_that_fused_permute_needs():
    """megatron-core's fused MoE permute raises "Please install TE >= 2.1.0" on older TE."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (te,) = [Requirement(r) for r in pyproject["project"]["optional-dependencies"]["gpu"]]
    assert te.name == "transformer-engine"
    assert not te.specifier.contains("2.0.0") and te.specifier.contains("2.1.0")
