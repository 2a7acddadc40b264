"""Trainer -> rollout servers weight sync after every step: distributed, tensor or disk.

All three walk the same stream (`model/hf_stream.py`): every trainer rank takes part in the
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
  bytes (`rollout/tensor_handles.py`); for servers on the trainer's own node. Colocated, each
  server's TP rank r takes entry r, so every trainer rank receives the whole stream on its own
  device and serializes its own copy; rank 0 gathers the entries (control plane) and posts each
  server the entries of the trainer ranks on its GPUs (`base_gpu_id`, `gpu_id_step`), as verl and
  slime hand over within an engine's TP group. Otherwise rank 0's copy serves every entry.
* disk: a full HF checkpoint written atomically and `/update_weights_from_disk`.

With `rollout.quantization=fp8` the stream's decoder projections are quantised to blockwise
FP8 with their `weight_scale_inv` tensors (`model/fp8.py`) one by one before bucketing, so the
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
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.config import WeightSyncConfig
from megatron_gspo.config.colocation import ColocationError
from megatron_gspo.errors import ConfigError
from megatron_gspo.model import control_plane
from megatron_gspo.model.config import MoEModelConfig
from megatron_gspo.model.distributed import compute_device
from megatron_gspo.model.fp8 import quantize_stream
from megatron_gspo.model.hf_export import export_hf_checkpoint
from megatron_gspo.model.hf_stream import (
    Bucket,
    iter_buckets,
    iter_hf_tensors,
    refuse_non_finite,
    run_on_hf_stream,
)
from megatron_gspo.rollout import tensor_handles
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.errors import RolloutFault, WeightUpdateError
from megatron_gspo.rollout.fleet import FleetTooSmallError
from megatron_gspo.rollout.server.weight_receiver import FLATTENED_BUCKET
from megatron_gspo.rollout.update_group import (
    abort_update_group,
    collective_timeout_s,
    destroy_update_group,
    free_port,
    init_update_group,
    master_address,
    timed_out,
    wait_for_bucket,
)
from megatron_gspo.training.server_checks import refuse_unfit_servers
from megatron_gspo.training.termination import protocol_step

logger = logging.getLogger(__name__)

GROUP_NAME = "megatron_gspo_weights"
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


@dataclass
class _Group:
    group: dist.ProcessGroup
    name: str
    urls: list[str]
    aborted: bool = False


@dataclass
class WeightSync:
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
            opened = functools.partial(_step, "begin_weight_update", opening.result)  # repeatable
            try:
                stats = send(client, _after_first(self._buckets(stream), opened), version)
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
            _step("end_weight_update", client.end_weight_update)
            stats.cache_flushed = _flush_cache(client)
            return stats

        return run_on_hf_stream(self.model, self.model_cfg, in_session)

    def _via_disk(self, client: SGLangClient | None, version: int) -> SyncStats:
        path = export_hf_checkpoint(self.model, self.export_dir, self.model_cfg, self.tokenizer)

        def load() -> SyncStats:
            client.update_weights_from_disk(str(path), weight_version=str(version))
            size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
            return SyncStats(bytes=size, buckets=1, largest_bucket_bytes=size)

        try:
            return control_plane.on_rank0(load)
        except Exception as err:
            raise WeightSyncFailed(f"{type(err).__name__}: {err}") from err

    def _buckets(self, stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[Bucket]:
        if self.quantization == "fp8":  # tensor by tensor as they stream: no full copy
            stream = quantize_stream(stream)
        return iter_buckets(stream, int(self.cfg.bucket_mb * 2**20))

    def _send_tensors(self, client: SGLangClient, buckets: Iterator[Bucket], version: int) -> SyncStats:
        """Send each bucket as SGLang's tensor handles (`rollout.tensor_handles`), never its bytes.

        One flat copy per bucket where a server can open it (the GPU's own memory on CUDA, shared
        memory on CPU), one handle pickle per TP rank of every server; the copy is kept until every
        server has answered, then dropped before the next bucket is packed.
        """
        stats = SyncStats()
        tp_sizes = [int(info.get("tp_size", 1)) for info in client.server_info()]
        device = compute_device()
        for bucket in buckets:
            flat = tensor_handles.shareable(bucket.flatten_and_release(device))
            per_server = [
                [
                    tensor_handles.serialize_flattened_bucket(
                        flat, bucket.names, bucket.dtypes, bucket.shapes
                    )
                    for _ in range(tp_size)
                ]
                for tp_size in tp_sizes
            ]
            _post_handles(client, bucket, per_server, version)
            stats.add(bucket)
            del flat, per_server  # answered: the servers hold their own copies now
        return stats

    def _via_own_devices(self, client: SGLangClient | None, version: int) -> SyncStats:
        """Colocated tensor sync (collective): each server rank takes the trainer's copy on its own GPU.

        Every rank walks the whole stream (the same buckets everywhere) and serializes its own flat
        copy of each bucket; rank 0 gathers the entries, posts them and broadcasts the outcome, so a
        refusal, or a rank that could not make its copy, ends the attempt on every rank at the same
        bucket. Each rank keeps its copy until the servers have answered for it.
        """
        world = dist.get_world_size() if dist.is_initialized() else 1
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        sources = control_plane.on_rank0(_handle_sources, client, world, per_node)
        stats, device = SyncStats(), compute_device()
        try:  # a refused begin is aborted too: a sender that died mid-sync leaves a session open
            control_plane.on_rank0(lambda: _step("begin_weight_update", client.begin_weight_update))
            stream = iter_hf_tensors(self.model, self.model_cfg, sender=True, every_rank=True)
            for bucket in self._buckets(stream):
                flat, own = None, None
                try:
                    flat = tensor_handles.shareable(bucket.flatten_and_release(device))
                    own = (
                        tensor_handles.serialize_flattened_bucket(
                            flat, bucket.names, bucket.dtypes, bucket.shapes
                        ),
                        None,
                    )
                except Exception as err:  # noqa: BLE001 - every rank learns it from rank 0, below
                    own = (None, f"{type(err).__name__}: {err}")
                entries = control_plane.all_gather_objects(own)
                control_plane.on_rank0(_post_own_devices, client, bucket, entries, sources, version)
                stats.add(bucket)
                del flat  # answered: the servers hold their own copies now
        except BaseException:
            with contextlib.suppress(Exception):
                control_plane.on_rank0(
                    lambda: client.end_weight_update(abort=True, timeout_s=self.cfg.release_timeout_s)
                )
            raise
        control_plane.on_rank0(lambda: _step("end_weight_update", client.end_weight_update))
        stats.cache_flushed = control_plane.on_rank0(_flush_cache, client)
        return stats

    def _send_distributed(self, client: SGLangClient, buckets: Iterator[Bucket], version: int) -> SyncStats:
        """Send bucket by bucket; each is answered before the next request goes out.

        So a refused bucket is known before any server enters another receive: no server is
        left waiting in a broadcast that will not come. What overlaps is the sender's own work:
        bucket k+1 is gathered while the servers receive and check bucket k. The sender holds
        about two buckets: k's flat copy while k+1's tensors are gathered, then k+1's tensors
        and their flat copy (made once k is answered; the tensors are dropped once copied).
        """
        stats = SyncStats()
        device = torch.device("cpu") if self._backend() == "gloo" else compute_device()
        in_flight: list[tuple] = []  # the bucket out, if any
        try:
            for bucket in buckets:
                if in_flight:  # popped first: its flat copy is freed before the next one is made
                    stats.add(self._finish(*in_flight.pop()))
                with protocol_step():  # a server told to receive always gets the broadcast
                    in_flight.append(self._start(client, bucket, bucket.flatten_and_release(device), version))
        except BaseException:  # an error or an exit with a bucket out: the servers finish it
            if in_flight:  # (within timeout_s) before the session is aborted
                with contextlib.suppress(Exception):
                    self._finish(*in_flight.pop())
            raise
        if in_flight:
            stats.add(self._finish(*in_flight.pop()))
        return stats

    def _start(self, client: SGLangClient, bucket: Bucket, flat: torch.Tensor, version: int) -> tuple:
        """Announce `bucket` to the servers (answers in the background), then broadcast it."""
        answers = client.update_weights_from_distributed(
            bucket.names,
            bucket.dtypes,
            bucket.shapes,
            group_name=self._group.name,
            flush_cache=False,
            weight_version=version if bucket.last else None,
            load_format=FLATTENED_BUCKET,
            blocking=False,
        )
        work = dist.broadcast(flat, group=self._group.group, group_src=0, async_op=True)
        return bucket, flat, work, answers

    def _finish(self, bucket: Bucket, flat: torch.Tensor, work, answers) -> Bucket:
        """Wait until every server received and accepted `bucket` (`flat` is alive until then).

        Past `timeout_s`, and under NCCL on any failure of the wait, rank 0's side of the group
        is aborted at once, before the rest of the stream is drained and the servers are
        released: under NCCL a broadcast still in flight would otherwise reach the group's
        timeout, where torch's watchdog ends the trainer (`rollout/update_group.py`). A gloo
        broadcast that failed has ended (no watchdog); its group is destroyed after the release,
        as before.
        """

        def wait() -> None:
            try:
                wait_for_bucket(work, answers, self.cfg.timeout_s)
            except BaseException as err:
                if timed_out(err) or self._backend() == "nccl":
                    self._abort_group()
                raise

        _at_bucket(bucket, wait)
        return bucket

    # ------------------------------------------------------------------ the group
    def _backend(self) -> str:
        if self.cfg.backend != "auto":
            return self.cfg.backend
        return "nccl" if torch.cuda.is_available() else "gloo"

    def _ensure_group(self, client: SGLangClient | None) -> None:
        """Rank 0 and every server rank join a fresh group unless one is up (collective)."""

        def join() -> None:
            if self._group is not None and self._group.urls == client.urls:
                return
            if self._group is not None:  # the router's workers changed: a group of the new ones
                self._leave_group(client)
            infos = client.server_info()
            refuse_unfit_servers(client.urls, infos, sync_method="distributed", routed_experts=False)
            tp_sizes = [int(info.get("tp_size", 1)) for info in infos]
            offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
            world = 1 + sum(tp_sizes)
            address = self.cfg.master_address or master_address(client.urls)
            port = self.cfg.master_port or free_port()
            self._generation += 1
            name = f"{GROUP_NAME}_{self._sender_id}_{self._generation}"  # never a half-dead group's keys
            with protocol_step():  # servers told to join always meet rank 0 there
                answers = client.init_weights_update_group(
                    master_address=address,
                    master_port=port,
                    world_size=world,
                    rank_offsets=offsets,
                    group_name=name,
                    backend=self._backend(),
                    blocking=False,
                )
                group = init_update_group(
                    master_address=address,
                    master_port=port,
                    rank=0,
                    world_size=world,
                    group_name=name,
                    backend=self._backend(),
                    timeout_s=self.cfg.timeout_s,
                    collective_timeout=collective_timeout_s(self._backend(), self.cfg.timeout_s),
                )
            answers.result(timeout=self.cfg.timeout_s)
            self._group = _Group(group, name, list(client.urls))
            logger.info("weight-update group %s: %d server rank(s) at %s:%d", name, world - 1, address, port)

        try:
            control_plane.on_rank0(join)
        except (ConfigError, FleetTooSmallError):
            raise  # a deployment no retry can fix; a fleet left too small by the old group's release
        except Exception as err:
            raise WeightSyncFailed(
                f"joining the weight-update group failed: {type(err).__name__}: {err}"
            ) from err

    def _drop_group(self, client: SGLangClient | None) -> None:
        control_plane.on_rank0(self._leave_group, client)

    def _abort_group(self) -> None:
        """Rank 0: abort this side of the group now (the servers are released by `_leave_group`)."""
        if self._group is None or self._group.aborted:
            return
        self._group.aborted = True
        logger.warning(
            "weight-update group %s aborted: a bucket failed (weight_sync.timeout_s, or NCCL)",
            self._group.name,
        )
        with contextlib.suppress(Exception):
            abort_update_group(self._group.group)

    def _leave_group(self, client: SGLangClient) -> None:
        """Rank 0: the servers and this rank leave the group (if one is up)."""
        group, self._group = self._group, None
        if group is None:
            return
        try:  # a dead server cannot leave (its group dies with it); a held one is set aside
            client.set_aside_held_workers(group.name, self.cfg.release_timeout_s)
        finally:
            if not group.aborted:  # an aborted group is already gone
                with contextlib.suppress(Exception):
                    destroy_update_group(group.group)


def _handle_sources(client: SGLangClient, world: int, per_node: int) -> list[list[int]]:
    """Rank 0: for each server, the trainer rank on the GPU of each of its TP ranks (colocated).

    The servers cover the nodes in the order listed (`launch/sglang_servers.sh` starts a node's
    in GPU order); within its node a server's TP rank r is on GPU `base_gpu_id + r * gpu_id_step`,
    SGLang's own placement, so the listing order inside a node does not matter. Each GPU must
    host exactly one server rank: a clash or a GPU outside the node is refused naming the server.
    """
    owner: dict[int, str] = {}
    sources, covered = [], 0
    for url, info in zip(client.urls, client.server_info(), strict=True):
        tp, base, step = (
            int(info.get(k, d)) for k, d in (("tp_size", 1), ("base_gpu_id", 0), ("gpu_id_step", 1))
        )
        node = covered // per_node
        gpus = [base + r * step for r in range(tp)]
        if node * per_node >= world or max(gpus) >= per_node:
            raise ColocationError(
                f"server {url} (tp_size={tp}, base_gpu_id={base}, gpu_id_step={step}) puts its ranks on "
                f"GPUs {gpus} of node {node}, outside the trainer's {world // per_node} node(s) of {per_node}"
            )
        ranks = [node * per_node + gpu for gpu in gpus]
        for rank, gpu in zip(ranks, gpus):
            if rank in owner:
                raise ColocationError(
                    f"servers {owner[rank]} and {url} both have a rank on GPU {gpu} of node {node}: each "
                    "GPU hosts one server rank (launch each with its own --base-gpu-id, as "
                    "launch/sglang_servers.sh does)"
                )
            owner[rank] = url
        sources.append(ranks)
        covered += tp
    return sources


def _readmit(client: SGLangClient) -> dict[str, float]:
    """Behind a router: workers synced on their way back rejoin it; the `fleet/*` metrics."""
    if client.router is None:
        return {}
    client.readmit_workers()
    return client.fleet.metrics()


def _post_own_devices(
    client: SGLangClient,
    bucket: Bucket,
    entries: list[tuple[str | None, str | None]],
    sources: list[list[int]],
    version: int,
) -> None:
    """Rank 0: post each server the entries of the trainer ranks on its GPUs (one per TP rank).

    `entries`: each rank's (entry, None), or (None, why) where it could not make its copy.
    """
    for rank, (_, error) in enumerate(entries):
        if error is not None:
            raise WeightSyncFailed(
                f"bucket {bucket.index}: rank {rank} could not hand over its copy: {error}"
            )
    _post_handles(client, bucket, [[entries[rank][0] for rank in ranks] for ranks in sources], version)


def _post_handles(client: SGLangClient, bucket: Bucket, per_server: list[list[str]], version: int) -> None:
    """One `/update_weights_from_tensor` per server: its entries, one per TP rank (version on the last)."""
    _at_bucket(
        bucket,
        lambda: client.update_weights_from_tensor(
            per_server,
            load_format=tensor_handles.FLATTENED_BUCKET,
            flush_cache=False,
            weight_version=version if bucket.last else None,
        ),
    )


def _at_bucket(bucket: Bucket, send) -> None:
    """Run `send`; a failure names the bucket and its first tensor."""
    try:
        send()
    except Exception as err:
        raise WeightSyncFailed(
            f"bucket {bucket.index} ({len(bucket.names)} tensors from {bucket.names[0]}, "
            f"{bucket.nbytes / 2**20:.1f} MiB): {err}"
        ) from err


def _after_first(buckets: Iterator[Bucket], wait) -> Iterator[Bucket]:
    """`buckets`, calling `wait()` once the first is packed and before it is handed on."""
    for i, bucket in enumerate(buckets):
        if i == 0:
            wait()
        yield bucket


def _step(what: str, call) -> None:
    try:
        call()
    except Exception as err:
        raise WeightSyncFailed(f"{what}: {err}") from err


def _flush_cache(client: SGLangClient) -> bool:
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
