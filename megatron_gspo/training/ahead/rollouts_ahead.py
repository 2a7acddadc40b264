"""Rank 0's rollouts ahead of training (`rollout.max_staleness >= 1`), as one step uses them.

`RolloutsAhead` starts the producer thread and its queue (`ahead.queue`), sets up what a
weight sync does to the requests in flight (`inflight_updates`, for `rollout.update_mode`
pause / partial), hands the trainer the oldest batch within the bound with the step's
staleness metrics, and holds the producer while the trainer syncs, evaluates or saves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from megatron_gspo.config import RolloutConfig
from megatron_gspo.rollout import RolloutBatch
from megatron_gspo.training.ahead.inflight_updates import InFlightUpdates
from megatron_gspo.training.ahead.queue import RolloutProducer, Taken, VersionedBatch
from megatron_gspo.training.ahead.staleness import (
    mask_stale_tokens,
    staleness_metrics,
    trainable_version,
    version_number,
)


def async_metrics(taken: Taken, trainer_version: int) -> dict[str, float]:
    """Staleness (per response token, from the versions the servers reported) and overlap."""
    batch, rollout_s = taken.item.batch, taken.item.rollout_s
    versions = torch.tensor([version_number(v, taken.item.weight_version) for v in batch.weight_versions])
    staleness = trainer_version - versions
    tokens = batch.response_lengths.float()
    return {
        "rollout/staleness_mean": float((staleness * tokens).sum() / tokens.sum().clamp(min=1)),
        "rollout/staleness_max": float(staleness.max()),
        "rollout/stale_groups_dropped": float(taken.stale_groups_dropped),
        "time/wait_rollout_s": taken.wait_s,
        "time/rollout_s": rollout_s,
        "perf/overlap": min(max(1.0 - taken.wait_s / rollout_s, 0.0), 1.0) if rollout_s > 0 else 0.0,
    }


class RolloutsAhead:
    """The producer, the in-flight update mode and the step's view of them (rank 0; a context manager).

    Args:
        rollout: the run's rollout settings (max_staleness >= 1, update_mode, pause_mode,
            mask_stale_segments).
        engine: the rollout engine whose client the producer drives (`engine.partial` is set for
            update_mode partial).
        produce: samples one batch at the given weight version.
        version: the trainer's current weight version.
        batches: how many batches the run will take (None: no end; `RolloutProducer`).
    """

    def __init__(
        self,
        rollout: RolloutConfig,
        engine,
        produce: Callable[[int], RolloutBatch],
        version: Callable[[], int],
        batches: int | None = None,
    ) -> None:
        self.rollout = rollout
        self.inflight = None
        bound = None  # drain: one version per batch, the one it started at
        if rollout.update_mode != "drain":  # syncs land mid-batch; the bound is on token versions
            self.inflight = InFlightUpdates(rollout.update_mode, engine.client, rollout.pause_mode)
            engine.partial = self.inflight.partial

            def bound(item: VersionedBatch) -> int:
                return trainable_version(
                    item.batch,
                    item.weight_version,
                    rollout.update_mode,
                    mask_stale=rollout.mask_stale_segments,
                )

        self.producer = RolloutProducer(
            produce,
            rollout.max_staleness,
            version,
            lambda b: b.batch_size // b.group_size,
            wait_in_flight=rollout.update_mode == "drain",
            bound_version=bound,
            cancel=engine.client.cancel_generation,  # a stopping run (SIGTERM) waits for no batch
            batches=batches,
        )
        if rollout.update_mode == "drain":  # a sync waits for the batch's responses, not its scoring
            engine.on_responses = self.producer.requests_done

    def __enter__(self) -> RolloutsAhead:
        self.producer.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.producer.__exit__(*exc)

    def take(self, version: int) -> Taken:
        """The oldest batch trainable at trainer version `version` (waits for one)."""
        return self.producer.take(version)

    def step_metrics(self, taken: Taken, batch: RolloutBatch | None, version: int) -> dict[str, float]:
        """Staleness and overlap of the taken batch; masks `batch`'s stale segments when asked to.

        `batch` is the scored batch (groups may have been trimmed), None when nothing is left.
        """
        metrics = async_metrics(taken, version)
        mode, started = self.rollout.update_mode, taken.item.weight_version
        if mode != "drain":  # per token, by the version that generated it
            metrics.update(staleness_metrics(taken.item.batch, started, version, mode))
        if self.rollout.mask_stale_segments and batch is not None:
            oldest = version - self.rollout.max_staleness
            metrics["rollout/stale_tokens_masked"] = float(mask_stale_tokens(batch, started, mode, oldest))
        return metrics

    def around_sync(self) -> contextlib.AbstractContextManager:
        """No batch starts inside; requests in flight wait (drain), are held (pause) or cut (partial)."""
        return self.inflight.around_sync(self.producer) if self.inflight else self.producer.paused()

    def paused(self) -> contextlib.AbstractContextManager:
        """No batch starts inside and none is in flight (evaluation, checkpoint)."""
        return self.producer.paused()
