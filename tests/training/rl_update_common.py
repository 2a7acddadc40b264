"""What the RL-update workers share: the tiny policy, a seeded batch of groups, one rank's plan."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_gspo.algorithms import compute_group_advantages
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, compute_device
from megatron_gspo.model.hf.convert import load_hf_checkpoint
from megatron_gspo.model.optim import wrap_ddp
from megatron_gspo.rollout import RolloutBatch, RolloutSample
from megatron_gspo.training.step.micro_batches import DataLayout
from megatron_gspo.training.step.scatter import scatter_rank_rows
from megatron_gspo.training.step.update import plan_rank_rows

G, GROUPS, MINI, T, LR = 4, 4, 2, 0.7, 0.1
MODEL = tiny(vocab_size=80)


def make_batch(response_length: Callable[[torch.Generator], int]) -> tuple[RolloutBatch, torch.Tensor]:
    """GROUPS groups of G: 2..6-token prompts, `response_length(gen)`-token responses, 0/1 rewards.

    Returns:
        The batch and its group-normalised advantages.
    """
    gen = torch.Generator().manual_seed(0)
    samples = []
    for g in range(GROUPS):
        prompt = torch.randint(3, 80, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen)
        for _ in range(G):
            r = response_length(gen)
            response = torch.randint(3, 80, (r,), generator=gen)
            reward = float(torch.rand((), generator=gen) > 0.5)
            samples.append(
                RolloutSample(prompt, response, torch.zeros(r), "stop", "0", group_index=g, reward=reward)
            )
    batch = RolloutBatch.from_samples(samples, G)
    return batch, compute_group_advantages(batch.rewards, G)[0]


def build_policy(parallel: ParallelConfig, hf: str) -> torch.nn.Module:
    """The tiny policy with the HF weights, DDP-wrapped (call after `init_distributed`)."""
    model = build_model(MODEL, parallel)
    load_hf_checkpoint(model, hf, MODEL)
    return wrap_ddp(model)


def rank_plan(batch: RolloutBatch, advantages: torch.Tensor, layout: DataLayout):
    """This rank's rows of the batch (scattered from rank 0) and its mini/micro-batch plan.

    Returns:
        (plan, rows): the plan `train_on_batch` runs and the rows it was cut from.
    """
    rank0 = dist.get_rank() == 0
    rows = scatter_rank_rows(
        batch if rank0 else None,
        advantages if rank0 else None,
        num_mini_batches=MINI,
        layout=layout,
        routed_experts=False,
        device=compute_device(),
    )
    return plan_rank_rows(rows, MINI, layout), rows
