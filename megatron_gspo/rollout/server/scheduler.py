"""Continuous request batching for the embedded rollout server.

HTTP handler threads `submit` rows; one background thread takes every row that arrives
within `batch_window_s` of the first (up to `max_batch_size`) and runs them as one
left-padded batch on the `GenerationEngine`. The window exists to gather concurrent
single-row requests: a batch request's rows arrive together (`submit_many`), so once one
is queued the batch starts without waiting out the window. Pausing holds the queue and, by
SGLang's `/pause_generation` modes, aborts the running batch or halts it at a step boundary
(`GenerationEngine.pause`); aborting marks rows so the engine stops them at the next token.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from megatron_gspo.rollout.server.engine import GenerationEngine, GenerationInput, GenerationOutput


@dataclass
class _Pending:
    rid: str
    item: GenerationInput
    future: Future


class BatchScheduler:
    """Collects concurrent generation rows into batches run by one worker thread."""

    def __init__(
        self, engine: GenerationEngine, *, batch_window_s: float = 0.005, max_batch_size: int = 256
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.engine = engine
        self.batch_window_s = batch_window_s
        self.max_batch_size = max_batch_size
        self._queue: list[_Pending] = []
        self._running: list[_Pending] = []
        self._cond = threading.Condition()
        self._paused = False
        self._pause_mode: str | None = None
        self._closed = False
        self._whole_request_queued = False  # a multi-row request is queued: no reason to wait
        self._thread = threading.Thread(target=self._loop, name="rollout-batcher", daemon=True)
        self._thread.start()

    def submit(self, rid: str, item: GenerationInput) -> Future:
        """Queue one row; the future resolves to its `GenerationOutput` (or the engine's exception)."""
        return self.submit_many([rid], [item])[0]

    def submit_many(self, rids: list[str], items: list[GenerationInput]) -> list[Future]:
        """Queue a request's rows together, one future per row (in order)."""
        pending = [_Pending(rid, item, Future()) for rid, item in zip(rids, items, strict=True)]
        with self._cond:
            if self._closed:
                raise RuntimeError("scheduler is closed")
            self._queue.extend(pending)
            self._whole_request_queued |= len(pending) > 1
            self._cond.notify_all()
        return [p.future for p in pending]

    @property
    def num_pending(self) -> int:
        """Rows waiting or running."""
        with self._cond:
            return len(self._queue) + len(self._running)

    @property
    def paused(self) -> bool:
        """Between `pause` and `resume`: no batch starts."""
        with self._cond:
            return self._paused

    def pause(self, mode: str = "abort") -> None:
        """Stop starting batches, and act on the running one as SGLang's pause `mode` does.

        `abort`: queued and running rows end at once with finish reason abort (their tokens so
        far returned). `in_place` / `retract`: the running batch halts at its next step with its
        KV cache kept / recomputed on resume; returns once no forward runs, so a weight update
        that follows cannot wait on the batch.
        """
        with self._cond:
            self._paused, self._pause_mode = True, mode
        if mode == "abort":
            self.abort_all()
        else:
            self.engine.pause(retract=mode == "retract")

    def resume(self) -> None:
        """Start batches again; a held batch goes on."""
        with self._cond:
            self._paused, self._pause_mode = False, None
            self._cond.notify_all()
        self.engine.resume()

    def idle_for_flush(self) -> bool:
        """Whether SGLang would flush its cache now (`Scheduler.is_fully_idle(ignore_waiting=paused)`).

        No batch may run, nor be held by an `in_place` pause (a `retract` pause moved it back to
        the waiting queue); queued rows count only unpaused (paused, SGLang ignores its waiting
        queue, and its tokenizer manager holds new requests back).
        """
        with self._cond:
            running = bool(self._running) and self._pause_mode != "retract"
            return not running and not (self._queue and not self._paused)

    def abort(self, rid: str) -> int:
        """Abort rows whose request id is `rid` (prefix match covers a batch's `rid-i` rows)."""
        return self._abort(lambda p: p.rid == rid or p.rid.startswith(f"{rid}-"))

    def abort_all(self) -> int:
        """Abort every queued and running row."""
        return self._abort(lambda p: True)

    def _abort(self, select) -> int:
        with self._cond:
            queued = [p for p in self._queue if select(p)]
            self._queue = [p for p in self._queue if not select(p)]
            running = [p for p in self._running if select(p)]
        for p in running:
            p.item.abort.set()
        for p in queued:
            p.future.set_result(
                GenerationOutput(
                    output_ids=[],
                    output_logprobs=[],
                    input_logprobs=None if p.item.logprob_start_len < 0 else [],
                    routed_experts=None,
                    finish_reason={"type": "abort", "message": "Abort in waiting queue"},
                    weight_version=self.engine.weight_version,
                    aborted_waiting=True,  # SGLang answers it from its tokenizer manager
                )
            )
        return len(queued) + len(running)

    def close(self) -> None:
        """Stop the worker: queued rows fail, running ones (held by a pause too) end as aborted."""
        with self._cond:
            self._closed = True
            leftover, self._queue = self._queue, []
            running = list(self._running)
            self._cond.notify_all()
        for p in leftover:
            p.future.set_exception(RuntimeError("server shutting down"))
        for p in running:
            p.item.abort.set()  # a batch held by a pause sees it and ends: exit never waits on /continue
        self._thread.join(timeout=60)

    def _take_batch(self) -> list[_Pending] | None:
        with self._cond:
            while not self._closed and (self._paused or not self._queue):
                self._cond.wait()
            if self._closed:
                return None
            deadline = time.monotonic() + self.batch_window_s
            while (
                len(self._queue) < self.max_batch_size and not self._closed and not self._whole_request_queued
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._paused or not self._queue:
                return []
            batch, self._queue = self._queue[: self.max_batch_size], self._queue[self.max_batch_size :]
            self._whole_request_queued &= bool(self._queue)  # the rest of a request beyond max_batch_size
            self._running = batch
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            if not batch:
                continue
            try:
                results = self.engine.generate([p.item for p in batch])
            except BaseException as exc:  # noqa: BLE001 - every waiter must learn of the failure
                results = [exc] * len(batch)
            with self._cond:  # no longer running once answered (a /flush_cache that follows is granted)
                self._running = []
            for p, result in zip(batch, results):
                if isinstance(result, BaseException):
                    p.future.set_exception(result)
                else:
                    p.future.set_result(result)
