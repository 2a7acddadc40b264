"""`engine.dtype: bf16` on CPU, in one process: megatron's mixed precision as on GPU.

The model is megatron's `Float16Module` (bf16 parameters and compute), DDP reduces gradients
in fp32 buffers, the optimizer (plain or distributed) keeps fp32 main parameters and copies
them back rounded to bf16. Log-probs of bf16 logits take the temperature and the log-softmax
in fp32, and HF export / import keep bf16 weights bit for bit.
"""

import json

import pytest
import torch
from safetensors import safe_open

from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.engine import EngineConfig
from megatron_gspo.model.hf.convert import load_hf_checkpoint
from megatron_gspo.model.hf.export import export_hf_checkpoint
from megatron_gspo.model.logprobs import packed_forward, sequence_logprobs
from megatron_gspo.model.optim import OptimConfig, build_optimizer, optimizer_step, wrap_ddp, zero_grads
from megatron_gspo.model.packing import pack_sequences
from megatron_gspo.model.sharding import gather_global_state_dict

BF16 = EngineConfig(dtype="bf16")
CFG = tiny(vocab_size=64)


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    init_distributed(ParallelConfig())
    yield
    destroy_distributed()


def samples(seed=0, n=6):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, CFG.vocab_size, (int(k),), generator=gen) for k in torch.randint(5, 30, (n,))]


def main_params(optimizer) -> list[torch.Tensor]:
    return [
        p for leaf in optimizer.chained_optimizers for g in leaf.optimizer.param_groups for p in g["params"]
    ]


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["adam", "distributed-adam"])
def test_train_steps_keep_bf16_weights_and_fp32_main_params(distributed_optimizer):
    from megatron.core.transformer.module import Float16Module

    model = build_model(CFG, ParallelConfig(), BF16)
    assert isinstance(model, Float16Module)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ddp = wrap_ddp(model, distributed_optimizer=distributed_optimizer)
    optimizer, scheduler = build_optimizer(
        ddp, OptimConfig(lr=3e-4, clip_grad=0.0), distributed_optimizer=distributed_optimizer
    )
    mains = main_params(optimizer)
    assert {p.dtype for p in mains} == {torch.float32}
    assert sum(p.numel() for p in mains) == sum(p.numel() for p in model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    main_before = [p.detach().clone() for p in mains]
    seqs, losses = samples(), []
    for _ in range(3):
        zero_grads(ddp, optimizer)
        logprobs, _ = sequence_logprobs(ddp, seqs)
        assert logprobs.dtype == torch.float32
        loss = -logprobs.sum() / sum(len(s) - 1 for s in seqs)
        loss.backward()
        assert {p.main_grad.dtype for p in model.parameters()} == {torch.float32}  # reduced in fp32
        stepped, grad_norm = optimizer_step(ddp, optimizer, scheduler)
        assert stepped and grad_norm > 0
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    norms = {n for n in before if "layernorm" in n}
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert norms and changed == set(before) - norms
    if not distributed_optimizer:  # every bf16 weight is its fp32 main param, rounded
        for p in model.parameters():
            assert p.main_param.dtype == torch.float32 and torch.equal(p, p.main_param.bfloat16())
    # Three Adam steps of lr 3e-4 move the RMSNorm gains (1.0) by less than half a bf16 ulp
    # (2^-9): their bf16 copies stay 1.0 while the fp32 main params keep the updates.
    gains = [p for p, p0 in zip(mains, main_before) if torch.all(p0 == 1.0)]
    assert len(gains) == len(norms) and all(0 < (p - 1.0).abs().max() < 2**-9 for p in gains)


def test_logprobs_of_bf16_logits_are_an_fp32_log_softmax():
    """Against log_softmax in float64 of the same forward's bf16 logits, at temperature 0.7."""
    model = build_model(tiny(vocab_size=64, init_std=0.2), ParallelConfig(), BF16).eval()
    packed, temperature, seen = pack_sequences(samples(seed=1), row_len=64), 0.7, []
    handle = model.module.output_layer.register_forward_hook(lambda m, i, out: seen.append(out[0]))
    with torch.no_grad():
        ours, _ = packed_forward(model, packed, temperature=temperature)
    handle.remove()
    logits = seen[0].transpose(0, 1)  # [R, L, V], before the policy's own hook
    assert logits.dtype == torch.bfloat16
    labels = packed.labels[..., None]
    exact = torch.log_softmax(logits.double() / temperature, -1).gather(-1, labels).squeeze(-1)
    in_bf16 = torch.log_softmax(logits / temperature, -1).gather(-1, labels).squeeze(-1)
    assert (ours.double() - exact).abs().max() < 1e-5  # fp32 roundoff of a log-softmax over 64 logits
    assert (in_bf16.double() - exact).abs().max() > 1e-3  # a bf16 temperature / log-softmax: resolved


def test_hf_export_writes_bf16_and_round_trips_exactly(tmp_path):
    source = build_model(CFG, ParallelConfig(), BF16)
    weights = gather_global_state_dict(source)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    out = export_hf_checkpoint(source, tmp_path / "hf", CFG)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    target = build_model(CFG, ParallelConfig(), BF16)  # other initial weights: the RNG moved on
    assert not all(torch.equal(t, weights[k]) for k, t in gather_global_state_dict(target).items())
    load_hf_checkpoint(target, out, CFG)
    loaded = gather_global_state_dict(target)
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)
    fp32 = build_model(CFG, ParallelConfig())  # bf16 values are exact in fp32 too
    load_hf_checkpoint(fp32, out, CFG)
    assert all(torch.equal(t, weights[k].float()) for k, t in gather_global_state_dict(fp32).items())
