"""The tensor method: each bucket handed to the servers as SGLang's tensor handles, never its bytes.

For servers on the trainer's own node (`weight_sync/tensor_handles.py`: CUDA IPC on GPU, shared
memory on CPU). Colocated, each server's TP rank r takes entry r, so every trainer rank receives
the whole stream on its own device and serializes its own copy; rank 0 gathers the entries and
posts each server those of the trainer ranks on its GPUs (`base_gpu_id`, `gpu_id_step`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch.distributed as dist

from megatron_gspo.config.colocation import ColocationError
from megatron_gspo.model import control_plane
from megatron_gspo.model.distributed import compute_device
from megatron_gspo.model.hf.stream import Bucket, iter_hf_tensors
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.weight_sync import ipc_allocation, tensor_handles
from megatron_gspo.weight_sync.session import (
    SyncStats,
    WeightSyncFailed,
    at_bucket,
    flush_cache,
    protocol_call,
)


class TensorMethod:
    """`WeightSync`'s tensor method (state: `cfg`, `model`, `model_cfg`, `_buckets`)."""

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
            with ipc_allocation.outside_expandable_segments(device):  # CUDA IPC cannot share those
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
            post_handles(client, bucket, per_server, version)
            stats.add(bucket)
            del flat, per_server  # answered: the servers hold their own copies now
        ipc_allocation.collect_ipc(device)
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
        sources = control_plane.on_rank0(handle_sources, client, world, per_node)
        stats, device = SyncStats(), compute_device()
        try:  # a refused begin is aborted too: a sender that died mid-sync leaves a session open
            control_plane.on_rank0(lambda: protocol_call("begin_weight_update", client.begin_weight_update))
            stream = iter_hf_tensors(self.model, self.model_cfg, sender=True, every_rank=True)
            for bucket in self._buckets(stream):
                flat, own = None, None
                try:
                    with ipc_allocation.outside_expandable_segments(device):  # CUDA IPC cannot share those
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
                control_plane.on_rank0(post_own_devices, client, bucket, entries, sources, version)
                stats.add(bucket)
                del flat  # answered: the servers hold their own copies now
        except BaseException:
            with contextlib.suppress(Exception):
                control_plane.on_rank0(
                    lambda: client.end_weight_update(abort=True, timeout_s=self.cfg.release_timeout_s)
                )
            raise
        finally:
            ipc_allocation.collect_ipc(device)  # the buckets' blocks the servers have closed
        control_plane.on_rank0(lambda: protocol_call("end_weight_update", client.end_weight_update))
        stats.cache_flushed = control_plane.on_rank0(flush_cache, client)
        return stats


def handle_sources(client: SGLangClient, world: int, per_node: int) -> list[list[int]]:
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


def post_own_devices(
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
    post_handles(client, bucket, [[entries[rank][0] for rank in ranks] for ranks in sources], version)


def post_handles(client: SGLangClient, bucket: Bucket, per_server: list[list[str]], version: int) -> None:
    """One `/update_weights_from_tensor` per server: its entries, one per TP rank (version on the last)."""
    at_bucket(
        bucket,
        lambda: client.update_weights_from_tensor(
            per_server,
            load_format=tensor_handles.FLATTENED_BUCKET,
            flush_cache=False,
            weight_version=version if bucket.last else None,
        ),
    )
