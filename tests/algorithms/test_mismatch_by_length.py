"""Rollout/trainer mismatch sums and their by-length buckets, against a hand-made batch."""

import math

import pytest
import torch

from megatron_gspo.algorithms import NUM_LENGTH_BUCKETS, mismatch_by_length, mismatch_sums
from megatron_gspo.algorithms.mismatch import bucket_bounds, bucket_label


def k3(d):
    return math.exp(d) - 1 - d


def batch(rows, width=6):
    """(trainer, rollout, mask) with trainer - rollout = the given per-row diffs, NaN padding."""
    trainer = torch.full((len(rows), width), float("nan"), dtype=torch.float64)
    rollout = torch.full_like(trainer, float("nan"))
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        n = len(row)
        rollout[i, :n] = -1.0 - 0.1 * torch.arange(n, dtype=torch.float64)
        trainer[i, :n] = rollout[i, :n] + torch.tensor(row, dtype=torch.float64)
        mask[i, :n] = True
    return trainer, rollout, mask


def test_buckets_of_a_hand_made_batch():
    # Lengths 1, 2, 3, 5 -> buckets "1", "2-3" (two responses), "4-7".
    rows = [[0.1], [0.2, -0.2], [0.3, 0.0, 0.0], [-0.1] * 5]
    table = mismatch_by_length(mismatch_sums(*batch(rows)))
    assert [r["bucket"] for r in table] == ["1", "2-3", "4-7"]
    one, two_three, four_seven = table
    assert (one["num_sequences"], one["num_tokens"]) == (1, 1)
    assert one["abs_diff_mean"] == pytest.approx(0.1)
    assert one["kl_k3"] == pytest.approx(k3(0.1))
    assert one["log_seq_ratio_mean"] == pytest.approx(0.1)
    assert (two_three["num_sequences"], two_three["num_tokens"]) == (2, 5)
    assert two_three["abs_diff_mean"] == pytest.approx(0.7 / 5)
    assert two_three["kl_k3"] == pytest.approx((k3(0.2) + k3(-0.2) + k3(0.3)) / 5)
    assert two_three["log_seq_ratio_mean"] == pytest.approx((0.0 + 0.1) / 2)  # mean of per-response means
    assert (four_seven["min_length"], four_seven["max_length"]) == (4, 7)
    assert four_seven["abs_diff_mean"] == pytest.approx(0.1)
    assert four_seven["kl_k3"] == pytest.approx(k3(-0.1))
    assert four_seven["log_seq_ratio_mean"] == pytest.approx(-0.1)


def test_sums_add_over_micro_batches():
    rows = [[0.1], [0.2, -0.2], [0.3, 0.0, 0.0], [-0.1] * 5]
    whole = mismatch_sums(*batch(rows))
    split = mismatch_sums(*batch(rows[:1])) + mismatch_sums(*batch(rows[1:]))
    torch.testing.assert_close(whole, split)
    assert whole.shape == (NUM_LENGTH_BUCKETS, 5) and whole.dtype == torch.float64


def test_bucket_edges_and_the_open_last_bucket():
    assert [bucket_label(b) for b in range(4)] == ["1", "2-3", "4-7", "8-15"]
    assert bucket_bounds(NUM_LENGTH_BUCKETS - 1) == (2**19, None)
    assert bucket_label(NUM_LENGTH_BUCKETS - 1) == "524288+"
    # 2^19 - 1 tokens: the last closed bucket; 2^19: the open one.
    n = 2**19
    trainer = torch.zeros(2, n, dtype=torch.float64)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, -1] = False
    table = mismatch_by_length(mismatch_sums(trainer, trainer - 0.5, mask))
    assert [(r["bucket"], r["num_tokens"]) for r in table] == [("262144-524287", n - 1), ("524288+", n)]
    assert all(r["abs_diff_mean"] == pytest.approx(0.5) for r in table)
