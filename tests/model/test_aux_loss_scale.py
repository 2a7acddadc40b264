"""The load-balancing aux loss: off in RL by default, weighted per micro-batch like the policy loss."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from forked_torchrun import torchrun

from megatron_gspo.config import load_config
from megatron_gspo.model.aux_loss import aux_loss_scale, set_aux_loss_scale
from megatron_gspo.model.builder import build_model, transformer_config
from megatron_gspo.model.config import qwen3_30b_a3b, tiny
from megatron_gspo.model.distributed import ParallelConfig, init_distributed
from megatron_gspo.model.engine import EngineConfig, KernelAvailability
from megatron_gspo.model.logprobs import packed_forward
from megatron_gspo.model.packing import pack_sequences, pad_to_shape

CPU = KernelAvailability(cuda=False, te=False, apex_grad_accum=False)


def test_rl_turns_the_checkpoints_aux_loss_off_unless_asked():
    assert load_config(None).algorithm.aux_loss_coeff == 0.0
    arch = qwen3_30b_a3b()  # the released checkpoint's router_aux_loss_coef
    assert arch.aux_loss_coeff == 0.001
    checkpoint = transformer_config(arch, ParallelConfig(), EngineConfig(), available=CPU)
    rl = transformer_config(arch, ParallelConfig(), EngineConfig(), aux_loss_coeff=0.0, available=CPU)
    asked = transformer_config(arch, ParallelConfig(), EngineConfig(), aux_loss_coeff=0.01, available=CPU)
    assert checkpoint.moe_router_load_balancing_type == "aux_loss" and checkpoint.moe_aux_loss_coeff == 0.001
    assert rl.moe_router_load_balancing_type == "none" and rl.moe_aux_loss_coeff == 0.0
    assert asked.moe_router_load_balancing_type == "aux_loss" and asked.moe_aux_loss_coeff == 0.01


def test_scales_sum_to_the_dp_factor_like_the_policy_loss():
    shares = torch.tensor([5.0, 11.0, 0.0], dtype=torch.float64)
    scales = [aux_loss_scale(s, shares.sum(), dp_size=4) for s in shares]
    assert all(s.dtype == torch.float32 for s in scales)
    assert torch.stack(scales).tolist() == pytest.approx([4 * 5 / 16, 4 * 11 / 16, 0.0])


@pytest.fixture(scope="module")
def aux_model():
    init_distributed(ParallelConfig(), seed=7)
    model = build_model(tiny(vocab_size=32, init_std=0.2), ParallelConfig(), aux_loss_coeff=0.5)
    return model.train()


def _aux_grads(model, micro_batches, scales):
    """Router weight gradients when only the aux loss backpropagates (the LM output times 0)."""
    model.zero_grad(set_to_none=True)
    for tokens, scale in zip(micro_batches, scales):
        set_aux_loss_scale(scale)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(1)[None, None]
        logits = model(input_ids=tokens, position_ids=positions, attention_mask=causal)
        (logits.float().sum() * 0.0).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if "router" in n and p.grad is not None}


def test_megatron_backward_applies_the_per_micro_batch_weight(aux_model):
    """Two micro-batches weighted n_mb / N equal the same combination of each one alone (scale 1)."""
    gen = torch.Generator().manual_seed(0)
    micro_batches = [
        torch.randint(0, 32, (1, 5), generator=gen),
        torch.randint(0, 32, (2, 11), generator=gen),
    ]
    shares = torch.tensor([5.0, 22.0], dtype=torch.float64)
    alone = [_aux_grads(aux_model, [mb], [torch.tensor(1.0)]) for mb in micro_batches]
    assert alone[0] and all(g.abs().sum() > 0 for g in alone[0].values())  # the aux loss is on
    for dp in (1, 2):
        scales = [aux_loss_scale(s, shares.sum(), dp_size=dp) for s in shares]
        got = _aux_grads(aux_model, micro_batches, scales)
        for name, grad in got.items():
            want = dp * (5 / 27 * alone[0][name] + 22 / 27 * alone[1][name])
            # fp32 sums in another order: an absolute slack relative to the gradient's scale, which
            # elements near zero (terms that cancel) need on some CPUs
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    set_aux_loss_scale(torch.tensor(1.0))  # megatron's default, for later tests in this process


def test_padding_adds_nothing_to_the_aux_loss(aux_model):
    """Padded positions (token 0) are kept out of routing statistics: a micro-batch padded to a
    larger shape (as TP's multiple or EP peers' shapes pad it) gives the aux-loss gradients of the
    same samples packed without padding, and token 0's embedding row (unused by the samples) none."""
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(3, 32, (n,), generator=gen) for n in (7, 5)]
    exact = pack_sequences(samples, row_len=12)  # one row of 12 tokens: no padding at all
    assert exact.padding_fraction == 0.0
    padded = pad_to_shape(pack_sequences(samples, pad_multiple=4), 3, 16)  # 2 rows of 8 -> 3 of 16

    def grads(packed):
        aux_model.zero_grad(set_to_none=True)
        set_aux_loss_scale(torch.tensor(1.0))
        logprobs, _ = packed_forward(aux_model, packed)
        (logprobs.sum() * 0.0).backward()
        return {n: p.grad.clone() for n, p in aux_model.named_parameters() if p.grad is not None}

    want, got = grads(exact), grads(padded)
    routers = [n for n in want if "router" in n]
    assert routers and all(want[n].abs().max() > 1e-4 for n in routers)  # the aux loss is on
    for name in routers:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-5, atol=1e-6 * want[name].abs().max().item()
        )
    embedding = "embedding.word_embeddings.weight"
    assert got[embedding][0].abs().max() == 0.0  # before: trained by padding's aux-loss gradient alone


@pytest.mark.multiprocess
@pytest.mark.parametrize("virtual_pipeline", [None, 2], ids=["pp2", "pp2_vpp2"])
def test_pipeline_backward_applies_each_micro_batch_its_own_weight(tmp_path, virtual_pipeline):
    """PP2, 1F1B, recompute: megatron resets the class-level scale after every forward, and stage 0
    runs the next forward before each backward; the weight set at backward start still wins.

    With two model chunks per stage (interleaved 1F1B) the micro-batches are padded with fillers,
    copies of the last real one: their aux-loss gradient must be zero, or the weighted run and the
    runs alone (3 fillers each) stop adding up."""
    worker = Path(__file__).with_name("pp_aux_loss_worker.py")
    cmd = [*torchrun(2, worker), "--out", str(tmp_path / "aux")]
    if virtual_pipeline:
        cmd += ["--virtual-pipeline", str(virtual_pipeline)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"aux.rank{rank}.json").read_text())
        assert result["grad_abs"] > 0.1  # the aux loss reaches this stage's routers
        assert result["weighted"] <= 1e-6, (rank, result)
        assert result["megatron_scale"] > 0.1  # what the schedule alone would give: caught
