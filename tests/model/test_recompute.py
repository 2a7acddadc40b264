"""Activation recompute: selective recompute (megatron's `recompute_modules`) and full recompute give
the gradients of no recompute, and each reruns what it says in the backward: selective core_attn
reruns the core attention but not the router (nor the MoE dispatch behind it), selective moe the
router but not the attention, full reruns both. (layernorm and moe_act need TransformerEngine:
refused here; tests/gpu runs them.)"""

import dataclasses

import pytest
import torch

from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, init_distributed
from megatron_gspo.model.engine import EngineConfig, KernelAvailability
from megatron_gspo.model.logprobs import sequence_logprobs

MODEL = tiny(vocab_size=64, init_std=0.2)
SELECTIVE = EngineConfig(recompute_granularity="selective", recompute_modules=["core_attn"])


@pytest.fixture(scope="module")
def weights():
    init_distributed(ParallelConfig(), seed=1234)
    state = build_model(MODEL, ParallelConfig()).state_dict()
    return {k: v.clone() for k, v in state.items() if v is not None}  # megatron keeps None extra states


def gradients_and_runs(engine: EngineConfig, weights) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Parameter gradients of sum(log-probs) on a fixed batch, and forward runs of each part."""
    model = build_model(MODEL, ParallelConfig(), engine)
    model.load_state_dict(weights)
    runs = {"core_attention": 0, "pre_mlp_layernorm": 0, "router": 0}
    for layer in model.decoder.layers:
        for part, module in (
            ("core_attention", layer.self_attention.core_attention),
            ("pre_mlp_layernorm", layer.pre_mlp_layernorm),
            ("router", layer.mlp.router),
        ):
            module.register_forward_hook(lambda *_, part=part: runs.__setitem__(part, runs[part] + 1))
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, MODEL.vocab_size, (n,), generator=gen) for n in (9, 14, 5)]
    logprobs, _ = sequence_logprobs(model, seqs)
    logprobs.sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, runs


def test_selective_and_full_recompute_give_the_gradients_of_none(weights):
    plain, plain_runs = gradients_and_runs(EngineConfig(), weights)
    selective, selective_runs = gradients_and_runs(SELECTIVE, weights)
    moe, moe_runs = gradients_and_runs(
        EngineConfig(recompute_granularity="selective", recompute_modules=["moe"]), weights
    )
    full, full_runs = gradients_and_runs(EngineConfig(recompute_granularity="full"), weights)
    layers = MODEL.num_layers
    assert plain_runs == {"core_attention": layers, "pre_mlp_layernorm": layers, "router": layers}
    # Selective: the core attention rebuilt in the backward, the router (MoE) not.
    assert selective_runs == {"core_attention": 2 * layers, "pre_mlp_layernorm": layers, "router": layers}
    assert moe_runs == {"core_attention": layers, "pre_mlp_layernorm": layers, "router": 2 * layers}
    assert full_runs == {"core_attention": 2 * layers, "pre_mlp_layernorm": 2 * layers, "router": 2 * layers}
    assert plain.keys() == selective.keys() == moe.keys() == full.keys()
    for name, grad in plain.items():
        assert grad.abs().max() > 0, name
        # The same kernels run again on the same inputs: the same gradients, bit for bit on CPU.
        torch.testing.assert_close(selective[name], grad, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(moe[name], grad, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(full[name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(recompute_granularity="partial"), "recompute_granularity must be full, selective or null"),
        (dict(recompute_modules=["moe_act"]), "apply to recompute_granularity=selective only"),
        (
            dict(recompute_activations=True, recompute_granularity="selective"),
            "engine.recompute_activations=true is full recompute",
        ),
        (dict(recompute_granularity="selective", recompute_modules=[]), "recomputes nothing"),
        (
            dict(recompute_granularity="selective", recompute_modules=["mlp"]),
            "['mlp'] is not a part of a Qwen3-MoE layer megatron recomputes; choose from",
        ),
    ],
)
def test_refused_recompute_settings_are_named(changes, message):
    with pytest.raises(ValueError) as err:
        EngineConfig(**changes)
    assert message in str(err.value)


def test_layernorm_and_moe_act_need_transformer_engine_and_moe_act_grouped_gemm():
    engine = EngineConfig(recompute_granularity="selective", recompute_modules=["moe_act", "layernorm"])
    with pytest.raises(ValueError, match=r"\['layernorm', 'moe_act'\]: megatron recomputes them through"):
        engine.check_hardware(KernelAvailability(cuda=False, te=False, apex_grad_accum=False))
    unfused = dataclasses.replace(engine, fused_kernels=False)
    with pytest.raises(ValueError, match="moe_act, which megatron recomputes in grouped-GEMM experts"):
        unfused.check_hardware(KernelAvailability(cuda=True, te=True, apex_grad_accum=False))
    engine.check_hardware(KernelAvailability(cuda=True, te=True, apex_grad_accum=False))  # TE grouped GEMM
