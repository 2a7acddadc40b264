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

    def start(self, client) -> None:
        """The trainer parks its state before the servers' first generation."""
        self.servers_up, self.client = True, client
        self.offload.offload()

    def to_training(self, client) -> dict[str, float]:
        """Servers free the KV cache, then the weights (rank 0 asks); every rank onloads."""
        t0 = time.perf_counter()
        on_rank0(lambda: _release(client))  # collective: no rank onloads before the servers freed
        t1 = time.perf_counter()
        self.offload.onload()
        return {"colocate/release_s": t1 - t0, "colocate/onload_s": time.perf_counter() - t1}

    def sync(self, client, send: Callable[[], T]) -> tuple[T, dict[str, float]]:
        """Park all but the weights; servers resume theirs; send; park the weights; servers get KV cache."""
        t0 = time.perf_counter()
        moved = self.offload.offload(keep_weights=True)  # the sync reads the parameters
        t1 = time.perf_counter()
        on_rank0(lambda: client.resume_memory_occupation([WEIGHTS]))
        result = send()
        t2 = time.perf_counter()
        moved += self.offload.offload()
        t3 = time.perf_counter()
        on_rank0(lambda: client.resume_memory_occupation([KV_CACHE]))
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
        freed = self.servers_up and on_rank0(_free_kv_cache, self.client)
        self.offload.onload()
        try:
            yield
        finally:
            self.offload.offload()
            if freed:
                on_rank0(lambda: self.client.resume_memory_occupation([KV_CACHE]))


def _free_kv_cache(client) -> bool:
    """Rank 0: the servers free their KV cache for a checkpoint; False (logged) when they cannot."""
    try:
        client.release_memory_occupation([KV_CACHE])
    except (RolloutFault, RolloutRequestError) as err:  # a lost server must not cost the checkpoint
        logger.warning("checkpoint: the servers keep their KV cache (%s); saving beside it", err)
        return False
    return True


def _release(client) -> None:
    """Rank 0: every server frees its KV cache, then its weights (SGLang's order)."""
    client.release_memory_occupation([KV_CACHE])
    client.release_memory_occupation([WEIGHTS])
