"""Token versions, the bound and stale-segment masking of responses that span weight versions."""

import pytest
import torch

from megatron_gspo.rollout import RolloutBatch, RolloutSample, StaleRolloutError, parse_generate_response
from megatron_gspo.rollout.errors import WeightVersionError
from megatron_gspo.rollout.types import Segment
from megatron_gspo.training.ahead.staleness import (
    check_not_older,
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


def test_token_versions_follow_segments_partial_and_pause_and_the_start_without_spans():
    a = batch().samples[0]
    assert token_versions(a, 3, "partial").tolist() == [3, 3, 4, 5, 5, 5]
    assert token_versions(a, 3, "pause").tolist() == [3, 3, 4, 5, 5, 5]  # SGLang's weight_versions spans
    assert token_versions(a, 3, "drain").tolist() == [5] * 6  # the reported version
    a.segments = None  # a server that reports no spans: the oldest each token can be
    assert token_versions(a, 3, "pause").tolist() == [3] * 6


def pause_response(spans, n):
    """An SGLang 0.5.23 /generate response held by a pause while weights moved on."""
    return {
        "text": "",
        "output_ids": list(range(10, 10 + n)),
        "meta_info": {
            "id": "r",
            "prompt_tokens": 2,
            "completion_tokens": n,
            "finish_reason": {"type": "length", "length": n},
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,
            "output_token_logprobs": [[-0.5, t, None] for t in range(10, 10 + n)],
        },
    }


def test_pause_mode_reads_the_spans_and_keeps_a_batch_the_start_version_would_drop():
    """Red before the fix: pause mode charged every token its batch's start version (3), so at
    trainer version 6 with max_staleness 2 (bound 4) the batch was dropped; its tokens are 4 and 5."""
    a = parse_generate_response(
        [1, 2],
        pause_response([{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 5}], 5),
        allow_mixed_versions=True,
    )
    b = parse_generate_response([1, 2], pause_response([{"version": "4", "start": 0, "end": 3}], 3))
    assert [(s.start, s.length, s.weight_version) for s in a.segments] == [(0, 2, "4"), (2, 3, "5")]
    rb = RolloutBatch.from_samples([a, b], 2)
    assert token_versions(a, 3, "pause").tolist() == [4, 4, 5, 5, 5]
    assert trainable_version(rb, 3, "pause", mask_stale=False) == 4  # within 6 - 2
    assert staleness_metrics(rb, 3, 6, "pause")["rollout/staleness_max"] == 2


def test_spans_that_do_not_tile_the_response_are_refused():
    gap = [{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 3, "end": 5}]
    with pytest.raises(WeightVersionError, match=r"weight_versions\[1\]"):
        parse_generate_response([1, 2], pause_response(gap, 5), allow_mixed_versions=True)
    short = [{"version": "4", "start": 0, "end": 4}]
    with pytest.raises(WeightVersionError, match="cover 4 tokens, the response has 5"):
        parse_generate_response([1, 2], pause_response(short, 5))
    mixed = [{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 5}]
    with pytest.raises(WeightVersionError, match="several weight versions"):  # drain: one policy per batch
        parse_generate_response([1, 2], pause_response(mixed, 5))


def test_the_bound_is_on_the_oldest_token_or_with_masking_on_each_response_newest():
    rb = batch()
    assert trainable_version(rb, 3, "partial", mask_stale=False) == 3
    assert trainable_version(rb, 3, "partial", mask_stale=True) == 3  # response b has only version 3
    metrics = staleness_metrics(rb, 3, 6, "partial")
    # staleness per token at trainer version 6: a: 3,3,2,1,1,1; b: 3,3,3,3
    assert metrics["rollout/staleness_max"] == 3
    assert abs(metrics["rollout/staleness_mean"] - 23 / 10) < 1e-12
    assert metrics["rollout/segments_mean"] == 2 and metrics["rollout/multi_segment_frac"] == 0.5


def test_with_masking_the_bound_is_the_oldest_of_the_responses_newest_tokens():
    # Both responses started at version 3 and span syncs: a's tokens 3,3,4,5,5,5, c's 3,4,4,4.
    # Newest tokens: a 5, c 4 -> the bound 4 (c must keep a token in the loss); oldest tokens 3, 3.
    a = sample(2, [("3", 2), ("4", 1), ("5", 3)], "5")
    c = sample(2, [("3", 1), ("4", 3)], "4")
    rb = RolloutBatch.from_samples([a, c], 2)
    assert trainable_version(rb, 3, "partial", mask_stale=True) == 4
    assert trainable_version(rb, 3, "partial", mask_stale=False) == 3
    # Under pause every token counts as the batch's start; under drain, the reported 5 and 4.
    assert trainable_version(rb, 3, "pause", mask_stale=False) == 3
    assert trainable_version(rb, 3, "drain", mask_stale=False) == 4


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


def test_a_segment_older_than_its_batch_start_is_refused_by_name():
    check_not_older(sample(2, [("3", 2), ("4", 1)], "4"), 3)
    bad = sample(2, [("3", 2), ("2", 1)], "2")
    bad.rid = "step4-p0-r1"
    with pytest.raises(
        StaleRolloutError, match=r"segment 1 \(tokens 2..3\) was generated by weight version 2"
    ):
        check_not_older(bad, 3)
    plain = sample(2, [("1", 2)], "1")
    plain.segments = None
    with pytest.raises(StaleRolloutError, match="the response was generated by weight version 1"):
        check_not_older(plain, 3)
