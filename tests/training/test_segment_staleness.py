"""Token versions, the bound and stale-segment masking of responses that span weight versions."""

import torch

from megatron_gspo.rollout import RolloutBatch, RolloutSample
from megatron_gspo.rollout.types import Segment
from megatron_gspo.training.segment_staleness import (
    mask_stale_tokens,
    staleness_metrics,
    token_versions,
    trainable_version,
)


def sample(prompt_len, segments, reported):
    length = sum(n for _, n in segments)
    return RolloutSample(
        prompt_ids=torch.arange(1, prompt_len + 1),
        response_ids=torch.arange(10, 10 + length),
        rollout_logprobs=torch.full((length,), -0.5),
        finish_reason="length",
        weight_version=reported,
        segments=[Segment(sum(n for _, n in segments[:i]), n, v) for i, (v, n) in enumerate(segments)],
    )


def batch():
    # Two responses to one prompt, started at version 3: one cut by two syncs, one by none.
    a = sample(2, [("3", 2), ("4", 1), ("5", 3)], "5")
    b = sample(2, [("3", 4)], "3")
    return RolloutBatch.from_samples([a, b], 2)


def test_token_versions_follow_segments_partial_and_the_start_under_pause():
    a = batch().samples[0]
    assert token_versions(a, 3, "partial").tolist() == [3, 3, 4, 5, 5, 5]
    assert token_versions(a, 3, "pause").tolist() == [3] * 6  # unobservable: the oldest it can be
    assert token_versions(a, 3, "drain").tolist() == [5] * 6  # the reported version


def test_the_bound_is_on_the_oldest_token_or_with_masking_on_each_response_newest():
    rb = batch()
    assert trainable_version(rb, 3, "partial", mask_stale=False) == 3
    assert trainable_version(rb, 3, "partial", mask_stale=True) == 3  # response b has only version 3
    metrics = staleness_metrics(rb, 3, 6, "partial")
    # staleness per token at trainer version 6: a: 3,3,2,1,1,1; b: 3,3,3,3
    assert metrics["rollout/staleness_max"] == 3
    assert abs(metrics["rollout/staleness_mean"] - 23 / 10) < 1e-12
    assert metrics["rollout/segments_mean"] == 2 and metrics["rollout/multi_segment_frac"] == 0.5


def test_masking_zeroes_exactly_the_tokens_of_stale_segments():
    rb = batch()
    before = rb.response_mask.clone()
    assert mask_stale_tokens(rb, 3, "partial", oldest=4) == 2 + 4
    # a's prompt is 2 tokens: its response starts at column 2; the two version-3 tokens go.
    expected = before.clone()
    expected[0, 2:4] = 0
    expected[1, 2:6] = 0
    assert torch.equal(rb.response_mask, expected)
    assert rb.response_mask[0, 4:8].tolist() == [1, 1, 1, 1]
