"""Where the trainer and the rollout servers take turns on the same GPUs (`rollout.placement`).

A colocated step, in order:

1. the servers generate (the trainer's state is parked in host memory);
2. `to_training`: the servers release their KV cache, then their weights; the trainer brings
   its parameters, gradient buffers and optimizer state back (`offload.TrainerOffload`);
3. the trainer trains;
4. `sync`: the trainer parks its gradients and optimizer state; the servers resume their
   weights' memory; the new weights arrive by tensor handles, read from the trainer's parameters
   on the device; the trainer parks its parameters; the servers resume their KV cache, ready to
   generate (verl's and slime's order: sync, then offload the parameters).

A disaggregated run has the same calls, with nothing released or parked.

A tag is never released twice: torch_memory_saver (SGLang's `--enable-memory-saver`) answers a
second pause of a tag with "Cannot pause allocation that is not active." and SGLang's scheduler
exits. A step that failed between a release and its resume (a weight sync that raised) would
release again at the next hand-over; `ServerMemory` remembers what the trainer released and has
not resumed, and releases only what the servers hold.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from megatron_gspo.model.control_plane import on_rank0
from megatron_gspo.placement.offload import TrainerOffload
from megatron_gspo.rollout.errors import RolloutFault, RolloutRequestError

logger = logging.getLogger(__name__)

T = TypeVar("T")

KV_CACHE, WEIGHTS = "kv_cache", "weights"


class Placement:
    """Disaggregated: the servers keep their GPUs; every hand-over is a no-op but the sync itself."""

    colocated = False

    def start(self, client) -> None:
        """Before the first generation (collective)."""

    def to_training(self, client) -> dict[str, float]:
        """After a generation, before training (collective); returns `colocate/*` timings."""
        return {}

    def sync(self, client, send: Callable[[], T]) -> tuple[T, dict[str, float]]:
        """After training: the weight sync `send` (collective) and its `colocate/*` timings."""
        return send(), {}

    @contextlib.contextmanager
    def state_on_device(self) -> Iterator[None]:
        """The trainer's state on its device inside (a checkpoint reads it)."""
        yield


class ServerMemory:
    """The memory tags the servers hold, as this trainer left them (rank 0 asks; every call is one tag).

    A release is counted before it is asked (one that failed may still have happened: it is
    never asked again until a resume succeeds); a resume only once answered.
    """

    def __init__(self) -> None:
        self.released: set[str] = set()

    def release(self, client, tag: str) -> bool:
        """Release `tag` unless it is released already; whether it was asked now."""
        if tag in self.released:
            logger.warning("the servers' %s is released already (not resumed since): not released again", tag)
            return False
        self.released.add(tag)
        client.release_memory_occupation([tag])
        return True

    def resume(self, client, tag: str) -> None:
        """Resume `tag` if this trainer released it."""
        if tag in self.released:
            client.resume_memory_occupation([tag])
            self.released.discard(tag)


class Colocated(Placement):
    """The trainer's state and the servers' memory take turns on the same GPUs.

    Args:
        offload: the rank's training state (parameters, gradient buffers, optimizer state).
    """

    colocated = True

    def __init__(self, offload: TrainerOffload) -> None:
        self.offload = offload
        self.servers_up = False
        """Every rank: the servers are up (`start`), so a checkpoint frees their KV cache."""
        self.client = None
        """Rank 0's rollout client (None on the other ranks)."""
        self.memory = ServerMemory()
        """Rank 0: what the servers hold (a tag is released only while they hold it)."""

    def start(self, client) -> None:
        """The trainer parks its state before the servers' first generation."""
        self.servers_up, self.client = True, client
        self.offload.offload()

    def to_training(self, client) -> dict[str, float]:
        """Servers free the KV cache, then the weights (rank 0 asks); every rank onloads."""
        t0 = time.perf_counter()
        on_rank0(lambda: self._release(client))  # collective: no rank onloads before the servers freed
        t1 = time.perf_counter()
        self.offload.onload()
        return {"colocate/release_s": t1 - t0, "colocate/onload_s": time.perf_counter() - t1}

    def sync(self, client, send: Callable[[], T]) -> tuple[T, dict[str, float]]:
        """Park all but the weights; servers resume theirs; send; park the weights; servers get KV cache."""
        t0 = time.perf_counter()
        moved = self.offload.offload(keep_weights=True)  # the sync reads the parameters
        t1 = time.perf_counter()
        on_rank0(lambda: self.memory.resume(client, WEIGHTS))
        result = send()
        t2 = time.perf_counter()
        moved += self.offload.offload()
        t3 = time.perf_counter()
        on_rank0(lambda: self.memory.resume(client, KV_CACHE))
        timings = {
            "colocate/offload_s": (t1 - t0) + (t3 - t2),
            "colocate/offload_bytes": float(moved),
            "colocate/resume_s": time.perf_counter() - t3,
        }
        return result, timings

    @contextlib.contextmanager
    def state_on_device(self) -> Iterator[None]:
        """Onload around a read of the trainer's state (a checkpoint), then park it again.

        The servers are idle between steps: they free their KV cache for the duration and keep
        their weights, which the state comes back beside (`plan --placement colocated`'s
        checkpoint save phase). Before the servers are up (the cold start's save) nothing is freed.
        """
        # servers_up is the same on every rank (on_rank0 is collective), and so is `freed`
        freed = self.servers_up and on_rank0(self._free_kv_cache, self.client)
        self.offload.onload()
        try:
            yield
        finally:
            self.offload.offload()
            if freed:
                on_rank0(lambda: self.memory.resume(self.client, KV_CACHE))

    def _free_kv_cache(self, client) -> bool:
        """Rank 0: the servers free their KV cache for a checkpoint; False (logged) when they cannot."""
        try:
            return self.memory.release(client, KV_CACHE)
        except (RolloutFault, RolloutRequestError) as err:  # a lost server must not cost the checkpoint
            logger.warning("checkpoint: the servers keep their KV cache (%s); saving beside it", err)
            return False

    def _release(self, client) -> None:
        """Rank 0: every server frees its KV cache, then its weights (SGLang's order)."""
        self.memory.release(client, KV_CACHE)
        self.memory.release(client, WEIGHTS)
