"""What every sync method shares: its stats and failure, a bucket's send named in its error, the calls."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from megatron_gspo.model.hf.stream import Bucket
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.errors import RolloutFault, WeightUpdateError

logger = logging.getLogger(__name__)

FLUSH_ATTEMPTS = 4
FLUSH_BACKOFF_S = 0.25
"""/flush_cache refused with 400 (requests in flight) is retried after 0.25, 0.5, 1 s."""


class WeightSyncFailed(RolloutFault):
    """Every attempt of a weight sync failed; the message names the server and the bucket."""


@dataclass
class SyncStats:
    """What one sync moved (rank 0's view)."""

    bytes: int = 0
    buckets: int = 0
    largest_bucket_bytes: int = 0
    attempts: int = 1
    cache_flushed: bool = True
    fleet: dict[str, float] = field(default_factory=dict)
    """`fleet/*` of a fleet behind a router (workers now, removed so far); empty otherwise."""

    def add(self, bucket: Bucket) -> None:
        """Count one bucket sent."""
        self.bytes += bucket.nbytes
        self.buckets += 1
        self.largest_bucket_bytes = max(self.largest_bucket_bytes, bucket.nbytes)

    def metrics(self) -> dict[str, float]:
        """`sync/*` metrics of the step."""
        return {
            "sync/bytes": float(self.bytes),
            "sync/buckets": float(self.buckets),
            "sync/largest_bucket_bytes": float(self.largest_bucket_bytes),
            "sync/attempts": float(self.attempts),
            "sync/cache_flushed": float(self.cache_flushed),
            **self.fleet,
        }


def at_bucket(bucket: Bucket, send) -> None:
    """Run `send`; a failure names the bucket and its first tensor."""
    try:
        send()
    except Exception as err:
        raise WeightSyncFailed(
            f"bucket {bucket.index} ({len(bucket.names)} tensors from {bucket.names[0]}, "
            f"{bucket.nbytes / 2**20:.1f} MiB): {err}"
        ) from err


def after_first(buckets: Iterator[Bucket], wait) -> Iterator[Bucket]:
    """`buckets`, calling `wait()` once the first is packed and before it is handed on."""
    for i, bucket in enumerate(buckets):
        if i == 0:
            wait()
        yield bucket


def protocol_call(what: str, call) -> None:
    """Run one session call (`call`); a failure is `WeightSyncFailed` naming `what`."""
    try:
        call()
    except Exception as err:
        raise WeightSyncFailed(f"{what}: {err}") from err


def flush_cache(client: SGLangClient) -> bool:
    """Flush the servers' prefix caches; whether every server did.

    SGLang answers /flush_cache with 400 while requests are still running or queued (the
    new weights are in place either way; only prompts cached before the sync would be
    reused). The 400 is waited out a few times, then the sync goes on with a warning. Inside an
    `in_place` pause it is asked once: the held requests stay running until generation
    continues, so no wait could see it flushed (their KV is the old weights' by design).
    """
    if client.paused_in_place:
        try:
            client.flush_cache()
            return True
        except WeightUpdateError as err:
            logger.info("/flush_cache refused while an in_place pause holds requests: %s", err)
            return False
    for attempt in range(FLUSH_ATTEMPTS):
        try:
            client.flush_cache()
            return True
        except WeightUpdateError as err:  # a 4xx: requests in flight on that server
            refusal = err
            if attempt + 1 < FLUSH_ATTEMPTS:
                time.sleep(FLUSH_BACKOFF_S * 2**attempt)
    logger.warning(
        "weights synced, but a server kept refusing /flush_cache (%s); prompts it cached before the "
        "sync may be served from KV computed with the previous weights until its cache turns over",
        refusal,
    )
    return False
