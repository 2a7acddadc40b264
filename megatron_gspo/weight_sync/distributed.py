"""The distributed method: rank 0 and every server rank share a weight-update group; buckets are broadcast.

The group is joined once (`/init_weights_update_group` in the background while rank 0 joins; NCCL
on GPU, gloo on CPU) and rebuilt when the servers behind the router change or an attempt failed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gspo.errors import ConfigError
from megatron_gspo.model import control_plane
from megatron_gspo.model.distributed import compute_device
from megatron_gspo.model.hf.stream import Bucket
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.fleet import FleetTooSmallError
from megatron_gspo.rollout.server_checks import refuse_unfit_servers
from megatron_gspo.termination import protocol_step
from megatron_gspo.weight_sync import tensor_handles
from megatron_gspo.weight_sync.session import SyncStats, WeightSyncFailed, at_bucket
from megatron_gspo.weight_sync.update_group import (
    abort_update_group,
    collective_timeout_s,
    destroy_update_group,
    free_port,
    init_update_group,
    join_watching,
    master_address,
    pick_backend,
    timed_out,
    wait_for_bucket,
)

logger = logging.getLogger(__name__)

GROUP_NAME = "megatron_gspo_weights"


@dataclass
class _Group:
    group: dist.ProcessGroup
    name: str
    urls: list[str]
    backend: str
    aborted: bool = False


class DistributedMethod:
    """`WeightSync`'s distributed method and its group.

    Uses the sync's `cfg`, `_group`, `_generation` and `_sender_id`.
    """

    def _send_distributed(self, client: SGLangClient, buckets: Iterator[Bucket], version: int) -> SyncStats:
        """Send bucket by bucket; each is answered before the next request goes out.

        So a refused bucket is known before any server enters another receive: no server is
        left waiting in a broadcast that will not come. What overlaps is the sender's own work:
        bucket k+1 is gathered while the servers receive and check bucket k. The sender holds
        about two buckets: k's flat copy while k+1's tensors are gathered, then k+1's tensors
        and their flat copy (made once k is answered; the tensors are dropped once copied).
        """
        stats = SyncStats()
        device = torch.device("cpu") if self._group.backend == "gloo" else compute_device()
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
            load_format=tensor_handles.FLATTENED_BUCKET,
            blocking=False,
        )
        work = dist.broadcast(flat, group=self._group.group, group_src=0, async_op=True)
        return bucket, flat, work, answers

    def _finish(self, bucket: Bucket, flat: torch.Tensor, work, answers) -> Bucket:
        """Wait until every server received and accepted `bucket` (`flat` is alive until then).

        Past `timeout_s`, and under NCCL on any failure of the wait, rank 0's side of the group
        is aborted at once, before the rest of the stream is drained and the servers are
        released: under NCCL a broadcast still in flight would otherwise reach the group's
        timeout, where torch's watchdog ends the trainer (`weight_sync/update_group.py`). A gloo
        broadcast that failed has ended (no watchdog); its group is destroyed after the release,
        as before.
        """

        def wait() -> None:
            try:
                wait_for_bucket(work, answers, self.cfg.timeout_s)
            except BaseException as err:
                if timed_out(err) or self._group.backend == "nccl":
                    self._abort_group()
                raise

        at_bucket(bucket, wait)
        return bucket

    def _ensure_group(self, client: SGLangClient | None) -> None:
        """Rank 0 and every server rank join a fresh group unless one is up (collective)."""

        def join() -> None:
            if self._group is not None and self._group.urls == client.urls:
                return
            if self._group is not None:  # the router's workers changed: a group of the new ones
                self._leave_group(client)
            infos = client.server_info()
            refuse_unfit_servers(client.urls, infos, sync_method="distributed", routed_experts=False)
            backend = pick_backend(self.cfg.backend, compute_device(), infos)
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
                    backend=backend,
                    blocking=False,
                )
                join = functools.partial(
                    init_update_group,
                    master_address=address,
                    master_port=port,
                    rank=0,
                    world_size=world,
                    group_name=name,
                    backend=backend,
                    timeout_s=self.cfg.timeout_s,
                    collective_timeout=collective_timeout_s(backend, self.cfg.timeout_s),
                )
                group = join_watching(join, answers, self.cfg.timeout_s)  # a refusal ends it at once
            self._group = _Group(group, name, list(client.urls), backend)
            ranks = world - 1
            logger.info(
                "weight-update group %s (%s): %d server rank(s) at %s:%d", name, backend, ranks, address, port
            )

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
