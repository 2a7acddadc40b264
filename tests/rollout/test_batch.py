"""RolloutBatch.from_samples: grouping, padding, token alignment, staleness and drop accounting."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.rollout.errors import (
    BatchLayoutError,
    EmptyBatchError,
    GroupError,
    InvalidLogprobError,
    LengthMismatchError,
    RolloutValidationError,
    StaleRolloutError,
)
from megatron_gspo.rollout.types import RolloutBatch, RolloutSample


def make(prompt, response, logprobs=None, *, version="1", group=None, routes=None, reward=None, rid=None):
    logprobs = logprobs if logprobs is not None else [-0.5 * (i + 1) for i in range(len(response))]
    return RolloutSample(
        prompt_ids=torch.tensor(prompt),
        response_ids=torch.tensor(response),
        rollout_logprobs=torch.tensor(logprobs, dtype=torch.float32),
        finish_reason="stop",
        weight_version=version,
        routed_experts=routes,
        group_index=group,
        reward=reward,
        rid=rid,
    )


def two_groups():
    return [
        make([1, 2, 3], [7, 8], [-0.25, -0.5], reward=1.0),
        make([1, 2, 3], [9], [-1.0], reward=0.0),
        make([4, 5], [6, 6, 6], [-0.125, -2.0, -3.0], reward=0.5),
        make([4, 5], [3, 2], [-4.0, -0.75]),
    ]


def test_samples_with_int32_ids_pad_like_int64_ones():
    as_int32 = [
        RolloutSample(**{**vars(s), "prompt_ids": s.prompt_ids.int(), "response_ids": s.response_ids.int()})
        for s in two_groups()
    ]
    expected = RolloutBatch.from_samples(two_groups(), group_size=2, pad_token_id=0)
    batch = RolloutBatch.from_samples(as_int32, group_size=2, pad_token_id=0)
    assert batch.tokens.dtype == torch.int64 and torch.equal(batch.tokens, expected.tokens)


def test_padding_masks_and_alignment_match_hand_written_tensors():
    batch = RolloutBatch.from_samples(two_groups(), group_size=2, pad_token_id=0)
    assert batch.batch_size == 4 and batch.num_groups == 2 and batch.group_size == 2
    assert batch.tokens.tolist() == [
        [1, 2, 3, 7, 8],
        [1, 2, 3, 9, 0],
        [4, 5, 6, 6, 6],
        [4, 5, 3, 2, 0],
    ]
    assert batch.response_mask.tolist() == [
        [0, 0, 0, 1, 1],
        [0, 0, 0, 1, 0],
        [0, 0, 1, 1, 1],
        [0, 0, 1, 1, 0],
    ]
    assert batch.attention_mask.tolist() == [
        [True] * 5,
        [True] * 4 + [False],
        [True] * 5,
        [True] * 4 + [False],
    ]
    assert batch.rollout_logprobs.tolist() == [
        [0, 0, 0, -0.25, -0.5],
        [0, 0, 0, -1.0, 0],
        [0, 0, -0.125, -2.0, -3.0],
        [0, 0, -4.0, -0.75, 0],
    ]
    assert batch.prompt_lengths.tolist() == [3, 3, 2, 2]
    assert batch.response_lengths.tolist() == [2, 1, 3, 2]
    assert batch.response_mask.dtype == torch.float32 and batch.rollout_logprobs.dtype == torch.float32
    rewards = batch.rewards.view(-1, batch.group_size)
    assert (
        rewards[0].tolist() == [1.0, 0.0] and rewards[1, 0].item() == 0.5 and math.isnan(rewards[1, 1].item())
    )
    assert batch.weight_versions == ["1"] * 4 and batch.finish_reasons == ["stop"] * 4
    assert batch.routed_experts is None and batch.padded_routed_experts() is None
    assert batch.stats["groups_kept"] == 2 and batch.stats["dropped_groups"] == 0


def test_trainer_logprobs_from_shifted_logits_land_on_rollout_positions():
    """The documented convention: logits at t-1 predict token t, stored at index t."""
    batch = RolloutBatch.from_samples(two_groups(), group_size=2)
    vocab = 10
    b, s = batch.tokens.shape
    # Logits whose softmax at position t-1 gives token t exactly the rollout probability.
    logits = torch.full((b, s, vocab), -1e4)
    for i in range(b):
        for t in range(1, s):
            if batch.response_mask[i, t]:
                p = math.exp(batch.rollout_logprobs[i, t].item())
                rest = (1 - p) / (vocab - 1)
                logits[i, t - 1] = math.log(rest) if rest > 0 else -1e4
                logits[i, t - 1, batch.tokens[i, t]] = math.log(p)
    logprobs = torch.zeros(b, s)
    logprobs[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    torch.testing.assert_close(logprobs * batch.response_mask, batch.rollout_logprobs, atol=1e-5, rtol=0)


def test_group_index_groups_interleaved_samples_group_major():
    samples = [
        make([1], [5], group=7, rid="a0"),
        make([2], [6], group=3, rid="b0"),
        make([1], [5, 5], group=7, rid="a1"),
        make([2], [6, 6], group=3, rid="b1"),
    ]
    batch = RolloutBatch.from_samples(samples, group_size=2)
    assert [s.rid for s in batch.samples] == ["a0", "a1", "b0", "b1"]
    assert batch.tokens[:, 0].tolist() == [1, 1, 2, 2]


def test_group_with_two_prompts_is_named():
    samples = two_groups()
    samples[1] = make([1, 2, 4], [9])
    with pytest.raises(GroupError) as info:
        RolloutBatch.from_samples(samples, group_size=2)
    assert info.value.field == "prompt_ids" and "group 0" in str(info.value)
    batch = RolloutBatch.from_samples(samples, group_size=2, on_invalid="drop")
    assert batch.num_groups == 1 and batch.tokens[:, 0].tolist() == [4, 4]
    assert batch.stats["dropped_prompt_mismatch"] == 1 and batch.stats["dropped_samples"] == 2


def test_incomplete_group_is_named_and_dropped_whole():
    samples = two_groups() + [make([8], [1])]
    with pytest.raises(GroupError) as info:
        RolloutBatch.from_samples(samples, group_size=2)
    assert info.value.field == "group_size" and "has 1 samples, expected 2" in str(info.value)
    batch = RolloutBatch.from_samples(samples, group_size=2, on_invalid="drop")
    assert batch.batch_size == 4
    assert batch.stats == {
        "groups_in": 3,
        "groups_kept": 2,
        "samples_kept": 4,
        "dropped_groups": 1,
        "dropped_samples": 1,
        "dropped_incomplete": 1,
        "dropped_prompt_mismatch": 0,
        "dropped_invalid": 0,
        "dropped_stale": 0,
    }


def test_stale_weight_version_is_detected_and_counted():
    samples = two_groups()
    samples[3] = make([4, 5], [3, 2], version="0")
    with pytest.raises(StaleRolloutError) as info:
        RolloutBatch.from_samples(samples, group_size=2, expected_weight_version=1)
    assert isinstance(info.value, RolloutValidationError)
    assert info.value.field == "weight_version" and "['0']" in str(info.value) and "'1'" in str(info.value)
    batch = RolloutBatch.from_samples(samples, group_size=2, expected_weight_version="1", on_invalid="drop")
    assert batch.num_groups == 1 and batch.tokens[0, :3].tolist() == [1, 2, 3]
    assert batch.stats["dropped_stale"] == 1 and batch.stats["dropped_samples"] == 2
    # Without an expected version nothing is checked.
    assert RolloutBatch.from_samples(samples, group_size=2).num_groups == 2


def test_unreported_version_counts_as_stale_when_a_version_is_expected():
    samples = [make([1], [2], version=None), make([1], [3], version=None)]
    with pytest.raises(StaleRolloutError):
        RolloutBatch.from_samples(samples, group_size=2, expected_weight_version="1")


@pytest.mark.parametrize(
    ("broken", "error"),
    [
        (make([4, 5], [3, 2], [-1.0, float("nan")]), InvalidLogprobError),
        (make([4, 5], [3, 2], [-1.0, 0.25]), InvalidLogprobError),
        (make([4, 5], [3, 2], [-1.0]), LengthMismatchError),
    ],
)
def test_inconsistent_sample_drops_its_group(broken, error):
    samples = two_groups()
    samples[2] = broken
    with pytest.raises(error):
        RolloutBatch.from_samples(samples, group_size=2)
    batch = RolloutBatch.from_samples(samples, group_size=2, on_invalid="drop")
    assert batch.num_groups == 1 and batch.stats["dropped_invalid"] == 1


def test_everything_dropped_is_an_error_not_an_empty_batch():
    samples = [make([1], [2], version="0"), make([1], [3], version="0")]
    with pytest.raises(EmptyBatchError, match="dropped_stale': 1"):
        RolloutBatch.from_samples(samples, group_size=2, expected_weight_version="1", on_invalid="drop")


def test_routed_experts_are_kept_and_padded():
    r0 = torch.tensor([[[0, 1]], [[2, 3]], [[1, 0]]], dtype=torch.uint8)  # P=2, R=2 -> 3 rows
    r1 = torch.tensor([[[3, 2]], [[0, 2]]], dtype=torch.uint8)  # P=2, R=1 -> 2 rows
    samples = [make([1, 2], [3, 4], routes=r0), make([1, 2], [5], routes=r1)]
    batch = RolloutBatch.from_samples(samples, group_size=2)
    assert batch.routed_experts[0] is r0 and batch.routed_experts[1] is r1
    padded = batch.padded_routed_experts()
    assert padded.shape == (2, 4, 1, 2) and padded.dtype == torch.uint8
    assert padded[0].tolist() == [[[0, 1]], [[2, 3]], [[1, 0]], [[0, 0]]]
    assert padded[1].tolist() == [[[3, 2]], [[0, 2]], [[0, 0]], [[0, 0]]]


def test_routed_expert_layout_must_agree():
    r = torch.zeros(2, 1, 2, dtype=torch.uint8)
    with pytest.raises(BatchLayoutError, match="present in 1 of 2"):
        RolloutBatch.from_samples([make([1], [2, 3], routes=r), make([1], [2, 4])], group_size=2)
    other = torch.zeros(2, 2, 2, dtype=torch.uint8)
    with pytest.raises(BatchLayoutError, match="disagree"):
        RolloutBatch.from_samples(
            [make([1], [2, 3], routes=r), make([1], [2, 4], routes=other)], group_size=2
        )
    wrong_rows = torch.zeros(5, 1, 2, dtype=torch.uint8)
    with pytest.raises(RolloutValidationError, match=r"expected \[P\+R-1=2"):
        RolloutBatch.from_samples(
            [make([1], [2, 3], routes=wrong_rows), make([1], [2, 4], routes=r)], group_size=2
        )


def test_bad_arguments():
    with pytest.raises(ValueError, match="on_invalid"):
        RolloutBatch.from_samples(two_groups(), group_size=2, on_invalid="ignore")
    with pytest.raises(ValueError, match="group_size"):
        RolloutBatch.from_samples(two_groups(), group_size=0)
    mixed = [make([1], [2], group=0), make([1], [3])]
    with pytest.raises(GroupError, match="set on 1 of 2"):
        RolloutBatch.from_samples(mixed, group_size=2)
    with pytest.raises(EmptyBatchError):
        RolloutBatch.from_samples([], group_size=2)
