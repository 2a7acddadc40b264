"""`RolloutsAhead` (rank 0's rollouts ahead of training) driven as the trainer drives it.

The trainer takes the oldest batch trainable at its weight version (`take`), reads the step's
staleness metrics from `step_metrics` (which, with `rollout.mask_stale_segments`, zeroes the
loss mask on the tokens of segments older than `version - max_staleness`) and syncs weights
inside `around_sync`. The producer is a real `RolloutProducer` thread: first with scripted
hand-built batches (the bound and the mask at their edges), then with the real
`RolloutEngine.sample_groups` against rollout servers stood in for at the HTTP client's
boundary (`rollout_standin.py`), a sync cutting a batch in flight (update_mode partial).
"""

import threading

import numpy as np
import pytest
import torch
from rollout_standin import TOKENIZER, VOCAB, StandInServers

from megatron_gspo.config import RolloutConfig
from megatron_gspo.rollout import RolloutBatch, RolloutSample, StaleRolloutError
from megatron_gspo.rollout.partial import PartialRollouts
from megatron_gspo.rollout.types import Segment
from megatron_gspo.tasks.arithmetic import AdditionTask
from megatron_gspo.training.ahead.rollouts_ahead import RolloutsAhead
from megatron_gspo.training.step.rollouts import RolloutEngine

WAIT_S = 60  # hang guards only: every wait below ends on an event


def partial_config(k, mask):
    return RolloutConfig(
        group_size=2, rollout_batch_size=3, max_new_tokens=4, max_staleness=k, update_mode="partial",
        mask_stale_segments=mask,
    )  # fmt: skip


def response(segments):
    """A 2-token prompt's response made of `segments` [(version, tokens)]; it reports the last one's."""
    length = sum(n for _, n in segments)
    starts = [sum(n for _, n in segments[:i]) for i in range(len(segments))]
    return RolloutSample(
        prompt_ids=torch.tensor([1, 2]),
        response_ids=torch.arange(10, 10 + length),
        rollout_logprobs=torch.full((length,), -0.5),
        finish_reason="length",
        weight_version=segments[-1][0],
        segments=[Segment(s, n, v) for s, (v, n) in zip(starts, segments)],
    )


def batch_of(*responses):
    """Groups of 2 consecutive responses."""
    return RolloutBatch.from_samples([response(segs) for segs in responses], 2)


class Engine:
    """What `RolloutsAhead` touches of the rollout engine: its client, `partial`, `on_responses`."""

    def __init__(self, client):
        self.client, self.partial, self.on_responses = client, None, None


class Scripted:
    """`produce`: the scripted batches in order, then fresh ones (every token at the version given)."""

    def __init__(self, batches, started_before=2):
        self.batches, self.started_at = list(batches), []
        self.started = threading.Event()  # set once `started_before` batches have started
        self.started_before = started_before

    def __call__(self, version):
        self.started_at.append(version)
        if len(self.started_at) == self.started_before:
            self.started.set()
        if self.batches:
            return self.batches.pop(0)
        return batch_of([(str(version), 2)], [(str(version), 2)])


def scripted_run(mask):
    """k = 2. Two batches start at trainer version 2; the trainer syncs to 5 and takes.

    At version 5 a token is within the bound when its version is >= 5 - 2 = 3:
    - batch 1 (2 groups): one response has only version-2 tokens, out of the bound either way;
    - batch 2 (1 group): a = 2,2,3,4,4 and b = 3,3,3. Its oldest token (2) is out of the bound,
      but each response's newest (4, 3) is within it: trainable only with the mask, which
      drops a's two version-2 tokens (version 5 - k - 1) and keeps the version-3 ones (5 - k).
    """
    servers = StandInServers("2")
    engine = Engine(servers)
    one = batch_of([("2", 1), ("3", 2)], [("2", 3)], [("2", 1), ("3", 2)], [("2", 1), ("3", 2)])
    two = batch_of([("2", 2), ("3", 1), ("4", 2)], [("3", 3)])
    produce = Scripted([one, two])
    trainer = {"version": 2}
    with RolloutsAhead(partial_config(2, mask), engine, produce, lambda: trainer["version"]) as ahead:
        assert isinstance(engine.partial, PartialRollouts) and engine.partial.client is servers
        assert engine.on_responses is None  # drain only: partial syncs do not wait for responses
        assert produce.started.wait(WAIT_S)
        for version in (3, 4, 5):
            with ahead.around_sync():  # as the trainer syncs: weights move with the gate held
                trainer["version"] = version
        taken = ahead.take(5)
        before = taken.item.batch.response_mask.clone()
        metrics = ahead.step_metrics(taken, taken.item.batch, 5)
    assert produce.started_at[:2] == [2, 2]
    assert servers.control == [("pause_generation", "abort"), ("continue_generation",)] * 3
    return two, taken, before, metrics


def test_with_the_mask_a_batch_whose_responses_each_keep_a_token_is_taken_and_its_stale_tokens_masked():
    two, taken, before, metrics = scripted_run(mask=True)
    assert taken.item.batch is two and taken.item.weight_version == 2
    assert taken.staleness == 2 and taken.stale_groups_dropped == 2  # batch 1's two groups
    assert metrics["rollout/stale_tokens_masked"] == 2
    expected = before.clone()
    expected[0, 2:4] = 0  # a's response starts after its 2 prompt tokens: its two version-2 tokens
    assert torch.equal(two.response_mask, expected)
    assert two.response_mask.tolist() == [[0, 0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0]]
    # Per token at version 5: a 3,3,2,1,1 and b 2,2,2 versions old.
    assert metrics["rollout/staleness_max"] == 3 and metrics["rollout/staleness_mean"] == 16 / 8
    assert metrics["rollout/segments_mean"] == 2 and metrics["rollout/multi_segment_frac"] == 0.5
    assert metrics["rollout/stale_groups_dropped"] == 2
    assert 0 <= metrics["perf/overlap"] <= 1 and metrics["time/wait_rollout_s"] >= 0


def test_without_the_mask_a_batch_with_a_token_out_of_the_bound_is_dropped_never_trained():
    two, taken, _, metrics = scripted_run(mask=False)
    # Batches 1 and 2 dropped (2 + 1 groups); the third, started after the syncs, is taken.
    assert taken.item.batch is not two and taken.item.weight_version == 5
    assert taken.staleness == 0 and taken.stale_groups_dropped == 3
    assert metrics["rollout/stale_groups_dropped"] == 3
    assert "rollout/stale_tokens_masked" not in metrics
    assert metrics["rollout/staleness_max"] == 0 and metrics["rollout/staleness_mean"] == 0
    assert taken.item.batch.response_mask.sum() == 4  # nothing masked


def engine_run(mask, reports=None):
    """k = 1, the real rollout step: the trainer takes batch 1 (version 3), then, while batch 2 is
    generating, syncs to version 5 (skipping one, as `debug.version_gap_at_step` does): the sync
    cuts batch 2's requests after one token each and they finish under version 5."""
    servers = StandInServers("3", reports=reports, hold_call=2)
    cfg = partial_config(1, mask)
    engine = RolloutEngine(servers, AdditionTask(max_digits=1), TOKENIZER, cfg, vocab_size=VOCAB)
    rng = np.random.default_rng(0)
    steps = []

    def produce(version):  # as the trainer's: the next prompts, sampled at the version given
        steps.append(len(steps) + 1)
        problems = [AdditionTask(max_digits=1).draw_problem(rng) for _ in range(cfg.rollout_batch_size)]
        return engine.sample_groups(problems, seed=1, step=steps[-1], weight_version=version)

    trainer = {"version": 3}
    with RolloutsAhead(cfg, engine, produce, lambda: trainer["version"]) as ahead:
        first = ahead.take(3)  # batch 1: generated at version 3 alone, nothing stale
        assert [s.segments for s in first.item.batch.samples] == [[Segment(0, 2, "3")]] * 6
        assert first.staleness == 0 and first.stale_groups_dropped == 0
        first_metrics = ahead.step_metrics(first, first.item.batch, 3)
        assert (
            first_metrics.get("rollout/stale_tokens_masked", 0) == 0
            and first_metrics["rollout/staleness_max"] == 0
        )
        assert servers.in_flight.wait(WAIT_S)  # batch 2's request is at the servers
        with ahead.around_sync():
            servers.version = "5"
            trainer["version"] = 5
        try:
            taken = ahead.take(5)
        finally:
            assert servers.control == [("pause_generation", "abort"), ("continue_generation",)]
        metrics = ahead.step_metrics(taken, taken.item.batch, 5)
    return taken, metrics


def test_a_batch_cut_by_a_sync_is_taken_with_its_older_segment_masked():
    taken, metrics = engine_run(mask=True)
    batch = taken.item.batch
    assert [s.rid for s in batch.samples] == [f"step2-p{p}-r{j}" for p in range(3) for j in range(2)]
    assert all(s.segments == [Segment(0, 1, "3"), Segment(1, 1, "5")] for s in batch.samples)
    assert taken.item.weight_version == 3 and taken.staleness == 0 and taken.stale_groups_dropped == 0
    # Version 3 < 5 - 1: each response's first token leaves the loss, its second stays.
    assert metrics["rollout/stale_tokens_masked"] == 6
    width = batch.tokens.shape[1]
    for b, sample in enumerate(batch.samples):  # prompt, the masked token, the kept one, padding
        p = sample.prompt_length
        assert batch.response_mask[b].tolist() == [0] * (p + 1) + [1] + [0] * (width - p - 2)
    # Per token: 5 - 3 = 2 and 5 - 5 = 0 versions old.
    assert metrics["rollout/staleness_max"] == 2 and metrics["rollout/staleness_mean"] == 1
    assert metrics["rollout/segments_mean"] == 2 and metrics["rollout/multi_segment_frac"] == 1


def test_without_the_mask_a_batch_cut_by_a_sync_is_dropped_and_the_next_one_trained():
    taken, metrics = engine_run(mask=False)
    batch = taken.item.batch
    assert [s.rid for s in batch.samples] == [f"step3-p{p}-r{j}" for p in range(3) for j in range(2)]
    assert taken.item.weight_version == 5 and taken.staleness == 0 and taken.stale_groups_dropped == 3
    assert all(s.segments == [Segment(0, 2, "5")] for s in batch.samples)
    assert "rollout/stale_tokens_masked" not in metrics and metrics["rollout/stale_groups_dropped"] == 3


def test_a_segment_older_than_its_batch_start_reaches_the_trainer_as_a_stale_rollout_error():
    # The server step2-p1-r0's resumption went to is still at version 2 (it missed the sync to 3).
    with pytest.raises(
        StaleRolloutError, match=r"sample step2-p1-r0: .*segment 1 \(tokens 1..2\) was generated"
    ):
        engine_run(mask=True, reports={"step2-p1-r0": "2"})
