"""torchrun worker: a TP x EP trainer streams its weights into an embedded rollout server.

    python -m torch.distributed.run --standalone --nproc_per_node 4 weight_sync_worker.py \
        --tp 2 --ep 2 --checkpoint DIR --result result.json

For each method (distributed, then tensor): perturb the trainer's weights, sync them as the
next weight version, and compare the server's teacher-forced log-probs with the trainer's.
Each rank also counts the bytes it receives in `all_gather` / `broadcast` calls during the sync
(`gathered`, one entry per rank), at the torch.distributed boundary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
from served import served_logprobs

from megatron_gspo.config import WeightSyncConfig
from megatron_gspo.model import control_plane
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.convert import load_hf_checkpoint, random_tokens, read_hf_config
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.logprobs import sequence_logprobs
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.training.weight_sync import WeightSync


def server_logprobs(client: SGLangClient | None, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T] teacher-forced log-probs from the server (column 0 is 0), on every rank."""

    def fetch() -> torch.Tensor:
        served = served_logprobs(client, tokens)
        return torch.cat([torch.zeros(len(served), 1, dtype=served.dtype), served], dim=1)

    return control_plane.on_rank0(fetch) if client is not None else control_plane.broadcast_from_rank0(None)


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--ep", type=int, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()

    import torch.distributed as dist

    parallel = ParallelConfig(tensor_parallel=args.tp, expert_parallel=args.ep)
    init_distributed(parallel, seed=7)
    cfg = read_hf_config(args.checkpoint)
    model = build_model(cfg, parallel).eval()
    load_hf_checkpoint(model, args.checkpoint, cfg)
    tokens = random_tokens(cfg.vocab_size, batch=3, length=24, seed=5)
    server = launch_embedded_server(args.checkpoint) if dist.get_rank() == 0 else None
    client = SGLangClient([server.url]) if server is not None else None
    results = {}
    try:
        for version, method in enumerate(("distributed", "tensor"), start=1):
            with torch.no_grad():  # same operation on every replica: replicated tensors stay equal
                for param in model.parameters():
                    param.mul_(0.9).add_(0.02 * version)
            ours, _ = sequence_logprobs(model, list(tokens), pad_multiple=args.tp)
            ours = ours.double()
            before = server_logprobs(client, tokens)
            sync = WeightSync(
                WeightSyncConfig(method=method, bucket_mb=0.05, timeout_s=120), model, cfg, args.result.parent
            )
            received = [0]
            with counting_received_bytes(received):
                stats = sync.sync(client, version)
            gathered = control_plane.all_gather_objects(received[0])
            after = server_logprobs(client, tokens)
            served_version = control_plane.on_rank0(lambda: client.model_info()[0]["weight_version"])
            sync.close(client)
            results[method] = {
                "before": (before - ours)[:, 1:].abs().max().item(),
                "after": (after - ours)[:, 1:].abs().max().item(),
                "version": served_version,
                "buckets": stats.buckets,
                "bytes": stats.bytes,
                "gathered": gathered,
            }
    finally:
        if server is not None:
            client.close()
            server.terminate()
    if dist.get_rank() == 0:
        args.result.write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    main()
