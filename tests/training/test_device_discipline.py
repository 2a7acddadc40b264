"""Tensors handed to the loss and to compute collectives are on the model's device, off the control group."""

import pytest
import torch.distributed as dist
from test_update import G, T, make_batch

from megatron_gspo.config import AlgorithmConfig, RolloutCorrectionConfig
from megatron_gspo.model import control_plane
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.optim import OptimConfig, build_optimizer, wrap_ddp
from megatron_gspo.training.step import update


@pytest.fixture(scope="module")
def policy():
    init_distributed(ParallelConfig(), seed=11)
    yield wrap_ddp(build_model(tiny(vocab_size=32), ParallelConfig()))
    destroy_distributed()


@pytest.mark.parametrize("old", ["rollout", "recompute", "recompute+tis"])
def test_loss_and_collective_tensors_live_on_the_model_device(policy, monkeypatch, old):
    old, _, correction = old.partition("+")
    device = next(policy.parameters()).device
    reduced, loss_inputs = [], []
    all_reduce, loss = dist.all_reduce, update.compute_policy_loss

    def recording_all_reduce(tensor, *args, group=None, **kwargs):
        reduced.append((tensor.device, group))
        return all_reduce(tensor, *args, group=group, **kwargs)

    def recording_loss(loss_type, *tensors, normalizer, **kwargs):
        weights = () if kwargs.get("token_weights") is None else (kwargs["token_weights"],)
        assert bool(weights) == bool(correction)
        loss_inputs.append([t.device for t in (*tensors, normalizer, *weights)])
        return loss(loss_type, *tensors, normalizer=normalizer, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recording_all_reduce)
    monkeypatch.setattr(update, "compute_policy_loss", recording_loss)
    batch, adv = make_batch(policy, seed=5)
    optimizer, scheduler = build_optimizer(policy, OptimConfig(lr=1e-6))
    rc = RolloutCorrectionConfig(correction, "sequence") if correction else RolloutCorrectionConfig()
    algo = AlgorithmConfig(loss_type="gspo", num_mini_batches=2, old_logprobs=old, rollout_correction=rc)
    plan = update.plan_mini_batches(batch, adv, 2, update.DataLayout(micro_batch_size=3))
    for micro in (m for mini in plan for m in mini):
        for tensor in (micro.response_mask, micro.old_logprobs, micro.rollout_logprobs, micro.advantages):
            assert tensor.device == device
    if old == "recompute":
        update.recompute_and_measure(policy, plan, T)
    update.train_on_batch(policy, optimizer, scheduler, plan, algo, temperature=T, max_response_length=4)
    assert batch.batch_size == 4 * G == 16 and len(loss_inputs) == 6  # per mini-batch of 8: 3 + 3 + 2 rows
    assert all(d == device for devices in loss_inputs for d in devices)
    # Normalisers (2), the finite-gradient flag (2), metric kinds, the mismatch: all on the compute plane.
    assert len(reduced) >= 6
    assert all(d == device for d, _ in reduced)
    assert all(group is not control_plane.control_group() for _, group in reduced)
