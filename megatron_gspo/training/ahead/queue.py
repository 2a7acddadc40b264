"""Rollouts ahead of training: rank 0's producer thread and the bounded queue of versioned batches.

With `rollout.max_staleness: k >= 1` a producer thread (rank 0; it drives the HTTP client
only, never the compute path) keeps sampling rollout batches while the trainer trains. The
two meet here:

- the producer starts a batch only while fewer than k batches wait unconsumed, so a batch
  started at weight version v is consumed at version <= v + k (one sync per consumed batch);
- a batch starts at a known weight version: it is started inside the gate, and the trainer
  syncs weights (and evaluates, and checkpoints) only with the gate held (`paused`). With
  `rollout.update_mode: drain` the gate also waits for the batch's requests to come back, so a
  batch is one version (its checks and scoring, after `requests_done`, overlap the sync); with
  pause / partial a sync lands mid-batch (`inflight_updates`);
- the consumer (`take`) drops every batch older than `version - k` and counts its groups.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class VersionedBatch:
    """A rollout batch and the weight version that generated it."""

    batch: Any
    weight_version: int
    rollout_s: float
    """Seconds the producer spent generating it."""


@dataclass
class Taken:
    """What `RolloutProducer.take` hands the trainer: a trainable batch and how it got it."""

    item: VersionedBatch
    staleness: int
    """Trainer version minus the batch's version (>= 0, <= the bound)."""
    wait_s: float
    """How long the trainer waited for it."""
    stale_groups_dropped: int
    """Groups of older batches dropped on the way to this one."""


class RolloutProducer:
    """A thread producing versioned rollout batches at most `max_staleness` versions ahead.

    Args:
        produce: `produce(weight_version)` -> one rollout batch (called in the thread, gate held).
        max_staleness: k >= 1.
        current_version: the trainer's weight version (read with the gate held).
        groups_of: the number of groups of a batch (for the dropped-groups count).
        wait_in_flight: `paused` waits for the batch being generated (one version per batch),
            until `produce` calls `requests_done`, or returns; False when syncs update weights
            with requests in flight (`inflight_updates`).
        bound_version: the version of a batch the bound is checked on (default: the version it
            was started at; responses spanning versions pass their oldest token's).
        cancel: ends the batch being generated (`close` calls it): a stopping run does not wait
            for a batch it will not train on.
        batches: how many batches the trainer will take in all (None: no end). No batch starts once
            that many are taken or on their way, so the last steps generate no batch nobody
            trains on (a dropped one is replaced).
    """

    def __init__(
        self,
        produce: Callable[[int], Any],
        max_staleness: int,
        current_version: Callable[[], int],
        groups_of: Callable[[Any], int],
        *,
        wait_in_flight: bool = True,
        bound_version: Callable[[VersionedBatch], int] | None = None,
        cancel: Callable[[], None] | None = None,
        batches: int | None = None,
    ):
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 for a producer, got {max_staleness}")
        self._produce, self._k = produce, max_staleness
        self._wait_in_flight = wait_in_flight
        self._bound_version = bound_version or (lambda item: item.weight_version)
        self._version, self._groups_of = current_version, groups_of
        self._cancel = cancel
        self._left = batches  # batches the trainer has still to take
        self._cond = threading.Condition()
        self._queue: deque[VersionedBatch] = deque()
        self._outstanding = 0  # started and not yet taken (in generation + queued)
        self._pause_requests = 0
        self._generating = False
        self._stop = False
        self._error: BaseException | None = None
        self.started = self.taken = self.dropped = 0
        """Batches started (a cancelled one too), handed to the trainer, and dropped as too old."""
        self._thread = threading.Thread(target=self._loop, name="rollout-producer", daemon=True)

    @property
    def max_staleness(self) -> int:
        """k: the bound."""
        return self._k

    def __enter__(self) -> RolloutProducer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the producer: no new batch starts, the current one is cancelled (or finished); join it."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._cancel is not None and self._thread.is_alive():
            self._cancel()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        # What the run's batch count (`batches`) allowed: the last step starts none nobody takes.
        logger.info(
            "rollouts ahead: %d batch(es) started, %d taken, %d dropped as stale",
            self.started,
            self.taken,
            self.dropped,
        )

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(
                        lambda: self._stop or (not self._pause_requests and self._outstanding < self._limit())
                    )
                    if self._stop:
                        return
                    self._generating, self._outstanding = True, self._outstanding + 1
                    self.started += 1
                    version = self._version()
                start = time.perf_counter()
                try:
                    batch = self._produce(version)
                finally:
                    with self._cond:
                        self._generating = False
                        self._cond.notify_all()
                with self._cond:
                    self._queue.append(VersionedBatch(batch, version, time.perf_counter() - start))
                    self._cond.notify_all()
        except BaseException as err:  # handed to the trainer by `take`
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _limit(self) -> int:
        """Most batches started and not yet taken: k, or fewer near the end."""
        return self._k if self._left is None else min(self._k, self._left)

    def requests_done(self) -> None:
        """Called by `produce` once its batch's responses are in: a sync may start from here.

        Nothing of the batch is left at the servers; its checks and scoring, which take rank 0's
        GIL, then overlap the sync instead of delaying it.
        """
        with self._cond:
            self._generating = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No batch starts inside, and (`wait_in_flight`) no request is in flight (sync, eval, checkpoint)."""
        with self._cond:
            self._pause_requests += 1
            self._cond.wait_for(lambda: not (self._generating and self._wait_in_flight))
        try:
            yield
        finally:
            with self._cond:
                self._pause_requests -= 1
                self._cond.notify_all()

    def take(self, version: int) -> Taken:
        """The oldest batch trainable at trainer `version`; older ones are dropped and counted.

        Raises:
            Whatever the producer raised (a bad batch with `on_invalid=raise`, a dead server).
        """
        start, dropped = time.perf_counter(), 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._error is not None)
                if self._error is not None and not self._queue:
                    raise self._error
                item = self._queue.popleft()
                self._outstanding -= 1
                self._cond.notify_all()
            staleness = version - self._bound_version(item)
            if staleness <= self._k:
                with self._cond:
                    if self._left is not None:
                        self._left -= 1
                    self.taken += 1
                return Taken(item, staleness, time.perf_counter() - start, dropped)
            self.dropped += 1
            dropped += self._groups_of(item.batch)
