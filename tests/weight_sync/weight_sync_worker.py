"""torchrun worker: a TP x EP trainer streams its weights into an embedded rollout server.

    python -m torch.distributed.run --standalone --nproc_per_node 4 weight_sync_worker.py \
        --tp 2 --ep 2 --checkpoint DIR --result result.json

For each method (distributed, then tensor): perturb the trainer's weights, sync them as the
next weight version, and compare the server's teacher-forced log-probs with the trainer's.
Each rank also counts the bytes it receives in `all_gather` / `broadcast` calls during the sync
(`gathered`, one entry per rank), at the torch.distributed boundary.

With `--colocated`, a third sync goes to two servers of TP 2 on the node's 4 "devices" (listed
as base GPU 2, then 0) by the colocated tensor path: `handle_pids` records, for each request,
the process whose shared memory each TP rank's entry names (in the shm name torch gives it), and
`pids` each trainer rank's process, so the test sees which rank's copy each server rank got.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # torchrun runs this file by path; tests/ holds served.py

from served import served_logprobs  # noqa: E402

from megatron_gspo.config import WeightSyncConfig
from megatron_gspo.model import control_plane
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.hf.convert import load_hf_checkpoint, random_tokens, read_hf_config
from megatron_gspo.model.logprobs import sequence_logprobs
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.weight_sync.sync import WeightSync


def served_gap(readers: list[SGLangClient] | None, tokens: torch.Tensor, ours: torch.Tensor) -> float:
    """Largest |server - trainer| teacher-forced log-prob over `readers`' servers (rank 0 reads them)."""

    def read() -> float:
        return max((served_logprobs(c, tokens) - ours[:, 1:]).abs().max().item() for c in readers)

    return control_plane.on_rank0(read)


@contextlib.contextmanager
def counting_received_bytes(counter: list[int]):
    """Adds to counter[0] the bytes this rank receives in `dist.all_gather` / `dist.broadcast` inside."""
    import torch.distributed as dist

    real_all_gather, real_broadcast = dist.all_gather, dist.broadcast

    def all_gather(tensor_list, tensor, *args, **kwargs):
        counter[0] += sum(t.numel() * t.element_size() for t in tensor_list)
        return real_all_gather(tensor_list, tensor, *args, **kwargs)

    def broadcast(tensor, *args, **kwargs):
        src = kwargs.get("src", args[0] if args else None)
        if src is None:  # given as a rank within the group
            src = dist.get_global_rank(kwargs["group"], kwargs["group_src"])
        if dist.get_rank() != src:
            counter[0] += tensor.numel() * tensor.element_size()
        return real_broadcast(tensor, *args, **kwargs)

    dist.all_gather, dist.broadcast = all_gather, broadcast
    try:
        yield
    finally:
        dist.all_gather, dist.broadcast = real_all_gather, real_broadcast


def recording_handle_pids(client: SGLangClient, record: list) -> None:
    """Append, per /update_weights_from_tensor call, each server's entries' shared-memory owner pids."""
    real = client.update_weights_from_tensor

    def send(per_server, **kwargs):
        record.append([[_shm_owner(entry) for entry in entries] for entries in per_server])
        return real(per_server, **kwargs)

    client.update_weights_from_tensor = send


def _shm_owner(entry: str) -> int:
    """The pid in the name of the one shared-memory segment an entry's pickle refers to."""
    (pid,) = set(re.findall(rb"/torch_([0-9]+)_", base64.b64decode(entry)))
    return int(pid)


def sync_and_compare(model, cfg, client, readers, tokens, args, version, method, colocated=False) -> dict:
    """Perturb the weights, sync them to `client`'s servers, compare `readers`' servers (rank 0's clients)."""
    with torch.no_grad():  # same operation on every replica: replicated tensors stay equal
        for param in model.parameters():
            param.mul_(0.9).add_(0.02 * version)
    ours, _ = sequence_logprobs(model, list(tokens), pad_multiple=args.tp)
    ours = ours.double()
    before = served_gap(readers, tokens, ours)
    config = WeightSyncConfig(method=method, bucket_mb=0.05, timeout_s=120)
    sync = WeightSync(config, model, cfg, args.result.parent, colocated=colocated)
    received = [0]
    with counting_received_bytes(received):
        stats = sync.sync(client, version)
    gathered = control_plane.all_gather_objects(received[0])
    after = served_gap(readers, tokens, ours)
    served_version = control_plane.on_rank0(lambda: [r.model_info()[0]["weight_version"] for r in readers])
    sync.close(client)
    return {
        "before": before,
        "after": after,
        "version": served_version,
        "buckets": stats.buckets,
        "bytes": stats.bytes,
        "gathered": gathered,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--ep", type=int, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--colocated", action="store_true")
    args = parser.parse_args()

    import torch.distributed as dist

    parallel = ParallelConfig(tensor_parallel=args.tp, expert_parallel=args.ep)
    init_distributed(parallel, seed=7)
    cfg = read_hf_config(args.checkpoint)
    model = build_model(cfg, parallel).eval()
    load_hf_checkpoint(model, args.checkpoint, cfg)
    tokens = random_tokens(cfg.vocab_size, batch=3, length=24, seed=5)
    rank0 = dist.get_rank() == 0
    servers = [launch_embedded_server(args.checkpoint)] if rank0 else []
    if rank0 and args.colocated:  # two servers of TP 2 over the node's 4 devices, listed out of order
        for base in (2, 0):
            servers.append(
                launch_embedded_server(
                    args.checkpoint, extra_args=("--tp-size", "2", "--base-gpu-id", str(base))
                )
            )
    clients = [SGLangClient([server.url]) for server in servers]
    results = {}
    try:
        for version, method in enumerate(("distributed", "tensor"), start=1):
            client = clients[0] if rank0 else None
            results[method] = sync_and_compare(model, cfg, client, clients[:1], tokens, args, version, method)
        if args.colocated:
            handle_pids: list = []
            colocated = SGLangClient([server.url for server in servers[1:]]) if rank0 else None
            if rank0:
                recording_handle_pids(colocated, handle_pids)
            results["colocated"] = sync_and_compare(
                model, cfg, colocated, clients[1:], tokens, args, 3, "tensor", colocated=True
            )
            results["colocated"]["handle_pids"] = handle_pids
            results["colocated"]["pids"] = control_plane.all_gather_objects(os.getpid())
            if rank0:
                colocated.close()
    finally:
        for client, server in zip(clients, servers):
            client.close()
            server.terminate()
    if dist.get_rank() == 0:
        args.result.write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    main()
