"""Rank 0's scoring of a sampled batch: advantages over the whole batch, then the rows trained on.

Advantages and the `rollout/*` metrics need the whole batch (groups, whitening, running reward
statistics), so they are computed before the rows are split over data-parallel ranks; the batch
is then trimmed to whole mini-batches x DP, and what every rank must know about it is gathered
into one small dict for the control plane.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_gspo.algorithms import RunningMeanStd, compute_group_advantages
from megatron_gspo.config import AlgorithmConfig, effective_reward_norm
from megatron_gspo.rollout import RolloutBatch
from megatron_gspo.training.step.metrics import rollout_metrics


def score_batch(
    batch: RolloutBatch, algo: AlgorithmConfig, running: RunningMeanStd | None, dp_size: int
) -> tuple[RolloutBatch | None, torch.Tensor, dict[str, Any]]:
    """A sampled batch's advantages and what every rank must know about it.

    Args:
        batch: the step's batch (rank 0).
        algo: `algorithm.*` (reward shaping, whitening, clips, mini-batches).
        running: running reward statistics (`reward_norm: running`; updated here), else None.
        dp_size: data-parallel ranks the rows are split over.

    Returns:
        (batch, advantages, shared): the batch trimmed to whole mini-batches x DP (None when no
        group is left), its advantages, and the metrics, dropped groups, whether every advantage
        is zero and the tokens trained on.
    """
    metrics = rollout_metrics(batch)
    token_kl = algo.add_token_level_kl  # then whitening and the advantage clip act per token, later
    advantages, adv_metrics = compute_group_advantages(
        batch.rewards,
        batch.group_size,
        eps=algo.advantage_eps,
        reward_clip=algo.reward_clip,
        reward_norm=effective_reward_norm(algo),
        reward_shift=algo.reward_shift,
        reward_scale=algo.reward_scale,
        whiten_advantages=algo.whiten_advantages and not token_kl,
        response_lengths=batch.response_lengths,
        advantage_clip=None if token_kl else algo.advantage_clip,
        running_stats=running,
    )
    metrics.update({k: float(v) for k, v in adv_metrics.items()})
    dropped = int(batch.stats.get("dropped_groups", 0))
    batch, advantages = fit_layout(batch, advantages, algo.num_mini_batches * dp_size)
    all_zero = batch is None or bool((advantages == 0).all())
    tokens = 0 if all_zero else int((batch.prompt_lengths + batch.response_lengths).sum())
    shared = {"metrics": metrics, "dropped_groups": dropped, "all_zero": all_zero, "train_tokens": tokens}
    return batch, advantages, shared


def fit_layout(
    batch: RolloutBatch, advantages: torch.Tensor, multiple: int
) -> tuple[RolloutBatch | None, torch.Tensor]:
    """Drop trailing groups (after dropped bad groups) so the rows split into mini-batches x DP."""
    keep = batch.batch_size - batch.batch_size % math.lcm(multiple, batch.group_size)
    if keep == batch.batch_size:
        return batch, advantages
    if not keep:
        return None, advantages[:0]
    trimmed = RolloutBatch.from_samples(
        batch.samples[:keep], batch.group_size, pad_token_id=int(batch.tokens[0, -1])
    )
    trimmed.stats = {**batch.stats, "trimmed_samples": batch.batch_size - keep}
    return trimmed, advantages[:keep]
