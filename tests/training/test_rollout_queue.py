"""The producer/consumer meeting point of asynchronous rollouts: bound, drops, pauses, shutdown."""

import threading
import time

import pytest

from megatron_gspo.training.ahead.queue import RolloutProducer


class Versions:
    """The trainer's weight version, as the producer reads it, plus what the producer saw."""

    def __init__(self):
        self.value = 0
        self.in_flight = threading.Event()  # set while a batch is being generated
        self.started_at: list[int] = []

    def produce(self, version, seconds=0.01):
        self.in_flight.set()
        self.started_at.append(version)
        time.sleep(seconds)
        self.in_flight.clear()
        return {"groups": 4, "version": version}


def run_trainer(producer, versions, steps, *, gap_at=None, train_s=0.02, batches=None):
    """Take, 'train', sync (version + 1, or + 2 at `gap_at`) with the producer paused."""
    taken, popped = [], 0
    for step in range(1, steps + 1):
        taken.append(producer.take(versions.value))
        popped += 1 + taken[-1].stale_groups_dropped // 4
        deadline = time.monotonic() + 10
        ahead = producer.max_staleness if batches is None else min(producer.max_staleness, batches - step)
        while len(versions.started_at) - popped < ahead:  # ran ahead as far as allowed
            assert time.monotonic() < deadline, "the producer did not run ahead"
            time.sleep(0.001)
        time.sleep(train_s)
        with producer.paused():
            assert not versions.in_flight.is_set(), "a weight sync with a rollout request in flight"
            versions.value += 2 if step == gap_at else 1
    return taken


@pytest.mark.parametrize("k", [1, 2])
def test_every_taken_batch_is_within_the_bound_and_the_queue_runs_ahead(k):
    versions = Versions()
    with RolloutProducer(versions.produce, k, lambda: versions.value, lambda b: b["groups"]) as producer:
        taken = run_trainer(producer, versions, 12)
    staleness = [t.staleness for t in taken]
    assert all(0 <= s <= k for s in staleness)
    assert staleness[k:] == [k] * (12 - k)  # a full queue: each batch is k versions old
    assert [t.item.weight_version for t in taken] == [t.item.batch["version"] for t in taken]
    assert sum(t.stale_groups_dropped for t in taken) == 0
    assert not producer._thread.is_alive()


def test_a_producer_told_the_run_length_starts_no_batch_past_the_last_step():
    versions = Versions()
    producer = RolloutProducer(versions.produce, 2, lambda: versions.value, lambda b: b["groups"], batches=5)
    with producer:
        taken = run_trainer(producer, versions, 5, batches=5)
    assert [t.staleness for t in taken] == [0, 1, 2, 2, 2]  # as far ahead as k allows until the end
    assert versions.started_at == [0, 0, 0, 1, 2]  # five batches: none for a sixth or seventh step


def test_a_batch_older_than_the_bound_is_dropped_and_counted_never_taken():
    versions = Versions()
    with RolloutProducer(versions.produce, 1, lambda: versions.value, lambda b: b["groups"]) as producer:
        taken = run_trainer(producer, versions, 5, gap_at=2)
    # Step 2's sync skips a version: the batch generated at version 1 meets trainer version 3.
    assert [t.staleness for t in taken] == [0, 1, 0, 1, 1]
    assert [t.stale_groups_dropped for t in taken] == [0, 0, 4, 0, 0]
    assert all(v - t.item.weight_version <= 1 for v, t in zip([0, 1, 3, 4, 5], taken))


def test_close_ends_a_producer_waiting_on_a_full_queue():
    versions = Versions()
    producer = RolloutProducer(versions.produce, 1, lambda: versions.value, lambda b: b["groups"])
    with producer:
        time.sleep(0.05)  # one batch made, the producer now waits for the trainer
    assert not producer._thread.is_alive()
    assert versions.started_at == [0]


def test_an_exception_in_the_producer_reaches_the_trainer_and_the_thread_ends():
    def produce(version):
        raise RuntimeError("rollout server died")

    producer = RolloutProducer(produce, 1, lambda: 0, lambda b: 1)
    with pytest.raises(RuntimeError, match="server died"), producer:
        producer.take(0)
    assert not producer._thread.is_alive()


def test_an_exception_in_the_trainer_stops_the_producer_mid_batch():
    versions = Versions()
    producer = RolloutProducer(
        lambda v: versions.produce(v, seconds=0.2), 2, lambda: versions.value, lambda b: b["groups"]
    )
    with pytest.raises(ValueError), producer:
        time.sleep(0.05)  # a batch is in flight
        raise ValueError("the trainer failed")
    assert not producer._thread.is_alive() and not versions.in_flight.is_set()
    assert versions.started_at == [0]  # no batch started after the close


def test_a_sync_waits_for_the_responses_not_for_the_scoring_after_requests_done():
    responses_in, scored, returned = threading.Event(), threading.Event(), threading.Event()

    def produce(version):  # requests at the servers, then the client-side checks and scoring
        time.sleep(0.05)
        producer.requests_done()
        responses_in.set()
        scored.wait(10)
        returned.set()
        return {"groups": 4, "version": version}

    producer = RolloutProducer(produce, 1, lambda: 0, lambda b: b["groups"])
    with producer:
        responses_in.wait(10)
        with producer.paused():  # entered while the batch is still being scored
            assert not returned.is_set()
            scored.set()
        assert producer.take(0).item.batch == {"groups": 4, "version": 0}


def test_a_sync_waits_for_a_batch_whose_requests_are_in_flight():
    versions = Versions()
    producer = RolloutProducer(
        lambda v: versions.produce(v, seconds=0.2), 1, lambda: versions.value, lambda b: b["groups"]
    )
    with producer:
        while not versions.in_flight.is_set():
            time.sleep(0.001)
        with producer.paused():
            assert not versions.in_flight.is_set()  # the batch ended before the sync began


def test_max_staleness_zero_has_no_producer():
    with pytest.raises(ValueError, match="max_staleness must be >= 1"):
        RolloutProducer(lambda v: None, 0, lambda: 0, lambda b: 0)
