"""Weight syncs with rollout requests in flight (`rollout.update_mode: pause | partial`), rank 0.

`drain` (the default) needs nothing here: the producer's gate makes a sync wait for the batch
being generated. The other modes let the sync land mid-batch; only new batches wait (the
producer's gate still holds them, so a batch starts at a known version):

- `pause`: every server pauses generation in SGLang's `rollout.pause_mode` (retract / in_place),
  the weights are updated while requests are held, and generation continues;
- `partial`: `PartialRollouts.sync` aborts the requests in flight (their tokens so far kept) and
  resubmits them under the new weights once the sync is done.

Behind a router a worker lost before or during the sync is dropped from the pause, the sync and
the continue (`fleet.FleetMixin.drop_lost_workers`); the others are continued whatever happened.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from megatron_gspo.rollout import SGLangClient
from megatron_gspo.rollout.partial import PartialRollouts
from megatron_gspo.training.ahead.queue import RolloutProducer


class InFlightUpdates:
    """What a weight sync does to the rollout requests in flight.

    Args:
        mode: `rollout.update_mode`, pause or partial.
        client: connected to every server the sync updates.
        pause_mode: `rollout.pause_mode` (mode pause).
    """

    def __init__(self, mode: str, client: SGLangClient, pause_mode: str = "retract"):
        if mode not in ("pause", "partial"):
            raise ValueError(f"update_mode must be pause or partial here, got {mode!r}")
        self.mode, self.client, self.pause_mode = mode, client, pause_mode
        self.partial = PartialRollouts(client) if mode == "partial" else None

    @contextlib.contextmanager
    def around_sync(self, producer: RolloutProducer) -> Iterator[None]:
        """No batch starts inside; requests in flight are held (pause) or cut and resumed (partial)."""
        with producer.paused():
            if self.partial is not None:
                with self.partial.sync():
                    yield
                return
            try:  # a pause that failed on one server still continues those it paused
                self.client.pause_generation(self.pause_mode)
                yield
            finally:
                self.client.continue_generation()
