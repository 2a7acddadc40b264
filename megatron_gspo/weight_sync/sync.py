"""Trainer -> rollout servers weight sync after every step: distributed, tensor or disk.

All three walk the same stream (`model/hf/stream.py`): every trainer rank takes part in the
TP/EP gathers, global rank 0 alone converts, buckets and sends. Per sync:

* distributed: the servers and rank 0 share a weight-update group (joined once:
  `/init_weights_update_group` in the background while rank 0 joins; NCCL on GPU, gloo on
  CPU); `/begin_weight_update`; per bucket `/update_weights_from_distributed` (flattened
  bucket, `weight_version` on the last) posted without blocking, then the broadcast; then
  `/end_weight_update` and one `/flush_cache` (SGLang's 400 while requests run is waited
  out, then warned about: the weights are in place either way; inside an `in_place` pause,
  which keeps its requests running, it is asked once).
* tensor: the same buckets as `/update_weights_from_tensor` requests inside a session, in SGLang's
  format: handles to each bucket's memory (CUDA IPC on GPU, shared memory on CPU), never its
  bytes (`weight_sync/tensor_handles.py`); for servers on the trainer's own node. Colocated, each
  server's TP rank r takes entry r, so every trainer rank receives the whole stream on its own
  device and serializes its own copy; rank 0 gathers the entries (control plane) and posts each
  server the entries of the trainer ranks on its GPUs (`base_gpu_id`, `gpu_id_step`), as verl and
  slime hand over within an engine's TP group. Otherwise rank 0's copy serves every entry.
* disk: a full HF checkpoint written atomically and `/update_weights_from_disk`.

With `rollout.quantization=fp8` the stream's decoder projections are quantised to blockwise
FP8 with their `weight_scale_inv` tensors (`model/fp8/blockwise.py`) one by one before bucketing, so the
buckets and `sync/bytes` carry FP8.

Rollouts are synchronous (generation has finished before training starts), so nothing is
generating during a sync and no pause is needed. A failed sync (a server refusing a bucket,
dying, or timing out) is retried from scratch `retries` times, with a fresh group for the
distributed method. A failed attempt leaves the servers with the buckets they loaded before it
(SGLang loads each as it arrives, and so does the embedded server) under the old
`weight_version`, which rides on the last bucket; a retry sends every bucket again. The last
failure is raised on every rank as `WeightSyncFailed`, naming the server and the bucket.

Behind SGLang's router the servers are the workers it lists, read again before a group is
joined (a group is rebuilt when they changed). A failed attempt first removes the workers
that no longer answer /model_info (from the router and the group; not /health, which SGLang
answers 503 after 20 s while the sync holds generation paused), so the retry syncs the rest;
below `rollout.min_workers` the run stops with `FleetTooSmallError` on every rank. A worker lost
mid-broadcast can hold others in the collective (SGLang cannot abort a receive): every wait on
them after a failure is bounded by `release_timeout_s`, and those still held are set aside until
they answer again (`fleet.FleetMixin.set_aside_held_workers`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_gspo.config import WeightSyncConfig
from megatron_gspo.model import control_plane
from megatron_gspo.model.config import MoEModelConfig
from megatron_gspo.model.fp8.blockwise import quantize_stream
from megatron_gspo.model.hf.stream import Bucket, iter_buckets, refuse_non_finite, run_on_hf_stream
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.fleet import FleetTooSmallError
from megatron_gspo.weight_sync.disk import DiskMethod
from megatron_gspo.weight_sync.distributed import DistributedMethod, _Group
from megatron_gspo.weight_sync.session import (
    SyncStats,
    WeightSyncFailed,
    after_first,
    flush_cache,
    protocol_call,
)
from megatron_gspo.weight_sync.tensors import TensorMethod

logger = logging.getLogger(__name__)


@dataclass
class WeightSync(DistributedMethod, TensorMethod, DiskMethod):
    """Sends the policy's weights to the servers behind `client` (collective: every rank calls)."""

    cfg: WeightSyncConfig
    model: torch.nn.Module
    model_cfg: MoEModelConfig
    export_dir: Path
    tokenizer: object = None
    quantization: str = "none"
    """`rollout.quantization`: fp8 sends blockwise FP8 weights with their scales."""
    colocated: bool = False
    """`rollout.placement: colocated`: the tensor method hands each server rank the memory of the
    trainer rank on its GPU (every rank gathers the whole model, a bucket at a time)."""
    _group: _Group | None = field(default=None, repr=False)
    _generation: int = 0
    _sender_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8], repr=False)
    """Part of every group name: a restarted trainer never reuses one that servers still hold
    from its predecessor (SGLang refuses a name it has; the join would wait out `timeout_s`)."""

    def sync(self, client: SGLangClient | None, weight_version: int) -> SyncStats:
        """Make every server serve the model's current weights as `weight_version`.

        Args:
            client: the servers (global rank 0; None elsewhere).
            weight_version: the version the servers report afterwards.

        Raises:
            WeightSyncFailed: on every rank, after `retries` + 1 failed attempts.
        """
        # Behind a router: who is there now, less those that stopped answering since the last sync,
        # plus removed ones answering again (added back to the router once synced, by `_readmit`).
        control_plane.on_rank0(lambda: client.remove_unhealthy_workers())
        for attempt in range(1, self.cfg.retries + 2):
            try:
                stats = self._attempt(client, weight_version)
            except WeightSyncFailed as err:
                logger.warning("weight sync attempt %d/%d failed: %s", attempt, self.cfg.retries + 1, err)
                self._drop_group(client)
                control_plane.on_rank0(lambda: client.remove_unhealthy_workers())  # the rest are retried
                if attempt == self.cfg.retries + 1:
                    raise WeightSyncFailed(f"weight sync failed {attempt} time(s); last: {err}") from None
                continue
            stats.attempts = attempt
            stats.fleet = control_plane.on_rank0(_readmit, client)
            return stats
        raise AssertionError("unreachable")

    def close(self, client: SGLangClient | None) -> None:
        """Leave the weight-update group (servers first; a held one is set aside, the run is over)."""
        with contextlib.suppress(FleetTooSmallError):
            self._drop_group(client)

    # ------------------------------------------------------------------ one attempt
    def _attempt(self, client: SGLangClient | None, version: int) -> SyncStats:
        if self.cfg.method == "disk":
            return self._via_disk(client, version)
        refuse_non_finite(self.model, "sync weights to the rollout servers")  # never serve NaN/inf
        if self.cfg.method == "tensor" and self.colocated:
            return self._via_own_devices(client, version)
        if self.cfg.method == "distributed":
            self._ensure_group(client)
        send = self._send_distributed if self.cfg.method == "distributed" else self._send_tensors

        def in_session(stream) -> SyncStats:
            opening = client.begin_weight_update(blocking=False)  # answered while bucket 0 is packed
            opened = functools.partial(protocol_call, "begin_weight_update", opening.result)  # repeatable
            try:
                stats = send(client, after_first(self._buckets(stream), opened), version)
                opened()  # an empty stream never asked
            except BaseException:
                with contextlib.suppress(Exception):
                    opening.result()  # a session ends only after its begin was answered
                # Even after a refused begin: SGLang refuses one while a session is open, as a
                # sender that died mid-sync leaves it, so the retry finds none. The embedded
                # server, as SGLang, keeps what it loaded (the retry overwrites it).
                with contextlib.suppress(Exception):
                    client.end_weight_update(abort=True, timeout_s=self.cfg.release_timeout_s)
                raise
            protocol_call("end_weight_update", client.end_weight_update)
            stats.cache_flushed = flush_cache(client)
            return stats

        return run_on_hf_stream(self.model, self.model_cfg, in_session)

    def _buckets(self, stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[Bucket]:
        if self.quantization == "fp8":  # tensor by tensor as they stream: no full copy
            stream = quantize_stream(stream)
        return iter_buckets(stream, int(self.cfg.bucket_mb * 2**20))


def _readmit(client: SGLangClient) -> dict[str, float]:
    """Behind a router: workers synced on their way back rejoin it; the `fleet/*` metrics."""
    if client.router is None:
        return {}
    client.readmit_workers()
    return client.fleet.metrics()
