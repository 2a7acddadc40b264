"""The tensor method: each bucket handed to the servers as SGLang's tensor handles, never its bytes.

For servers on the trainer's own node (`weight_sync/tensor_handles.py`: CUDA IPC on GPU, shared
memory on CPU). Colocated, each server's TP rank r takes entry r, so every trainer rank receives
the whole stream on its own device and serializes its own copy; rank 0 gathers the entries and
posts each server those of the trainer ranks on its GPUs (`base_gpu_id`, `gpu_id_step`), on its
host (`handle_sources`).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Sequence
from urllib.parse import urlparse

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
        stats, device = SyncStats(), compute_device()
        urls = control_plane.broadcast_from_rank0(list(client.urls) if client is not None else None)
        # Each rank says which GPU it is on and which servers share its host: the servers are
        # matched to the trainer ranks on their own host, whatever order c10d gave the nodes.
        local_gpu = device.index if device.type == "cuda" else int(os.environ.get("LOCAL_RANK", "0"))
        placements = control_plane.all_gather_objects((local_gpu, [on_this_host(url) for url in urls]))
        sources = control_plane.on_rank0(handle_sources, client, placements)
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


def on_this_host(url: str) -> bool:
    """Whether the server at `url` runs on this host: its address is one of this host's own.

    A UDP `connect` sends nothing; the source address it picks for a local address is that address
    itself (loopback for loopback), and another host's address is reached from one of ours.
    """
    host = urlparse(url).hostname or ""
    try:
        addr = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((addr, 9))
            return sock.getsockname()[0] == addr or addr.startswith("127.")
    except OSError:
        return False


def handle_sources(client: SGLangClient, placements: Sequence[tuple[int, Sequence[bool]]]) -> list[list[int]]:
    """Rank 0: for each server, the trainer rank on the GPU of each of its TP ranks (colocated).

    `placements[rank]` is (the GPU that rank is on, whether each server runs on that rank's host).
    Within its host a server's TP rank r is on GPU `base_gpu_id + r * gpu_id_step`, SGLang's own
    placement; its source is the trainer rank on that host and GPU, found from the ranks' own
    report, not from their global numbers (c10d numbers the nodes in the order they join). Each GPU
    must host exactly one server rank: a clash, a GPU no trainer rank on the host holds, or a
    server no rank (or ranks of several hosts, a `localhost` URL on several nodes) calls local is
    refused naming the server.
    """
    owner: dict[int, str] = {}
    sources = []
    for index, (url, info) in enumerate(zip(client.urls, client.server_info(), strict=True)):
        tp, base, step = (
            int(info.get(k, d)) for k, d in (("tp_size", 1), ("base_gpu_id", 0), ("gpu_id_step", 1))
        )
        gpus = [base + r * step for r in range(tp)]
        local = {rank: gpu for rank, (gpu, here) in enumerate(placements) if here[index]}
        if not local:
            raise ColocationError(f"server {url} runs on no host of the trainer's ranks (colocated)")
        ranks = []
        for gpu in gpus:
            on_gpu = [rank for rank, held in local.items() if held == gpu]
            if len(on_gpu) != 1:
                raise ColocationError(
                    f"server {url} (tp_size={tp}, base_gpu_id={base}, gpu_id_step={step}) puts a rank on "
                    f"GPU {gpu} of its host, where trainer ranks {on_gpu} are (one is needed; a server "
                    "listed as localhost on several nodes is local to each: list it by its host's name)"
                )
            ranks.append(on_gpu[0])
        for rank, gpu in zip(ranks, gpus):
            if rank in owner:
                raise ColocationError(
                    f"servers {owner[rank]} and {url} both have a rank on GPU {gpu} of trainer rank "
                    f"{rank}'s host: each GPU hosts one server rank (launch each with its own "
                    "--base-gpu-id, as launch/sglang_servers.sh does)"
                )
            owner[rank] = url
        sources.append(ranks)
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
