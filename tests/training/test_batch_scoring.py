"""Rank 0's scoring of a batch: group advantages by hand, and the trim to mini-batches x DP."""

import pytest
import torch

from megatron_gspo.config import AlgorithmConfig
from megatron_gspo.rollout import RolloutBatch, RolloutSample
from megatron_gspo.training.step.scoring import fit_layout, score_batch


def batch_of(rewards: list[list[float]]) -> RolloutBatch:
    """Groups with these rewards; responses of 1 + (index in group) tokens after a 2-token prompt."""
    samples = [
        RolloutSample(torch.tensor([5, 6]), torch.arange(3, 4 + i), torch.zeros(1 + i), "stop", "0",
                      group_index=g, reward=r)
        for g, group in enumerate(rewards)
        for i, r in enumerate(group)
    ]  # fmt: skip
    return RolloutBatch.from_samples(samples, len(rewards[0]))


def test_advantages_by_hand_and_the_trim_to_whole_mini_batches():
    batch = batch_of([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    algo = AlgorithmConfig(num_mini_batches=2, whiten_advantages=False, advantage_clip=None)
    kept, advantages, shared = score_batch(batch, algo, None, dp_size=1)
    # lcm(2 mini-batches x 1 rank, groups of 2) = 2 rows: 6 rows stay; group 0's mean is 0.5.
    assert kept is batch and advantages.shape == (6,)
    assert advantages[0] > 0 > advantages[1] and advantages[0] == pytest.approx(-advantages[1])
    assert advantages[2:].abs().max() == 0
    assert shared["metrics"]["rollout/reward_mean"] == pytest.approx(0.5)
    assert not shared["all_zero"] and shared["train_tokens"] == 6 * 2 + (1 + 2) * 3

    kept, advantages, shared = score_batch(batch, algo, None, dp_size=2)  # lcm(4, 2): 4 rows
    assert kept.batch_size == 4 == advantages.numel() and kept.stats["trimmed_samples"] == 2
    assert shared["train_tokens"] == 4 * 2 + (1 + 2) * 2


def test_a_batch_smaller_than_one_mini_batch_per_rank_is_all_zero():
    batch = batch_of([[1.0, 0.0]])
    kept, advantages, shared = score_batch(batch, AlgorithmConfig(num_mini_batches=4), None, dp_size=1)
    assert kept is None and advantages.numel() == 0 and shared["all_zero"] and shared["train_tokens"] == 0
    kept, advantages = fit_layout(batch, torch.ones(2), 2)  # already whole: the same batch
    assert kept is batch and torch.equal(advantages, torch.ones(2))
