"""torchrun worker of the per-rank scatter test (see test_batch_scatter.py).

    python -m torch.distributed.run --standalone --nproc_per_node 4 scatter_worker.py --result DIR

Every rank builds the same synthetic batch; only rank 0 hands it to `scatter_rank_rows`. For
each layout each rank compares what it received with the rows `dp_rows` assigns to its
data-parallel rank, cut locally from the full batch, and writes its findings to DIR/rank{r}.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.model import control_plane
from megatron_gspo.model.distributed import (
    ParallelConfig,
    compute_device,
    destroy_distributed,
    init_distributed,
)
from megatron_gspo.rollout import RolloutBatch, RolloutSample
from megatron_gspo.training.step.micro_batches import DataLayout, dp_rows
from megatron_gspo.training.step.scatter import RankRows, scatter_rank_rows

G, GROUPS, MINI, LAYERS, TOPK = 4, 4, 2, 3, 2
LAYOUTS = {"tp2": (2, 1, 1), "ep2": (1, 2, 1), "tp2ep2": (2, 2, 1), "cp2": (1, 1, 2), "tp2cp2": (2, 1, 2)}


def make_batch(seed: int = 0) -> tuple[RolloutBatch, torch.Tensor]:
    """Groups of random lengths with routed experts; advantages distinct per row."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for g in range(GROUPS):
        prompt = torch.randint(3, 90, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen)
        for _ in range(G):
            r = int(torch.randint(1, 9, (1,), generator=gen))
            samples.append(
                RolloutSample(
                    prompt,
                    torch.randint(3, 90, (r,), generator=gen),
                    -torch.rand(r, generator=gen),
                    "stop",
                    "0",
                    routed_experts=torch.randint(0, 8, (len(prompt) + r - 1, LAYERS, TOPK), generator=gen).to(
                        torch.uint8
                    ),
                    group_index=g,
                    reward=float(torch.rand((), generator=gen)),
                )
            )
    batch = RolloutBatch.from_samples(samples, G, pad_token_id=1)
    return batch, torch.randn(batch.batch_size, generator=gen)


def same(a: RankRows, b: RankRows) -> list[str]:
    """Names of the fields that differ."""
    bad = [
        name
        for name in (
            "tokens",
            "prompt_lengths",
            "response_lengths",
            "response_mask",
            "rollout_logprobs",
            "advantages",
        )
        if not torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu())
    ]
    if (a.routed_experts is None) != (b.routed_experts is None):
        bad.append("routed_experts")
    elif a.routed_experts is not None and not all(
        torch.equal(x, y) for x, y in zip(a.routed_experts, b.routed_experts, strict=True)
    ):
        bad.append("routed_experts")
    return bad


def record_groups(calls: list) -> None:
    """Record the group and tensor device of every collective the scatter makes."""
    for name in ("broadcast_object_list", "scatter", "broadcast"):
        original = getattr(dist, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
            calls.append((_name, kwargs.get("group"), None if tensor is None else str(tensor.device)))
            return _original(*args, **kwargs)

        setattr(dist, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    full, advantages = make_batch()
    out: dict = {}
    calls: list = []
    for layout, (tp, ep, cp) in LAYOUTS.items():
        init_distributed(ParallelConfig(tensor_parallel=tp, expert_parallel=ep, context_parallel=cp))
        from megatron.core import parallel_state as ps

        rank, dp_rank, dp_size = (
            dist.get_rank(),
            ps.get_data_parallel_rank(),
            ps.get_data_parallel_world_size(),
        )
        mine = dp_rows(full.batch_size, MINI, dp_rank, dp_size)
        for routes in (False, True):
            calls.clear()
            record_groups(calls)
            got = scatter_rank_rows(
                full if rank == 0 else None,
                advantages if rank == 0 else None,
                num_mini_batches=MINI,
                layout=DataLayout.from_megatron(0, 1),
                routed_experts=routes,
                device=compute_device(),
            )
            for name in ("broadcast_object_list", "scatter", "broadcast"):
                setattr(dist, name, getattr(dist.distributed_c10d, name))
            expected = RankRows.from_batch(
                full, advantages, mine, routed_experts=routes, micro_batch_sizes=[[len(mine) // MINI]] * MINI
            )
            control = control_plane.control_group()
            out[f"{layout}/routes={routes}"] = {
                "dp_rank": dp_rank,
                "dp_size": dp_size,
                "rows": got.num_rows,
                "expected_rows": len(mine),
                "mismatch": same(got, expected),
                "has_routes": got.routed_experts is not None,
                "object_calls": sum(n == "broadcast_object_list" for n, _, _ in calls),
                "object_calls_on_control": all(
                    g is control for n, g, _ in calls if n == "broadcast_object_list"
                ),
                "data_calls": [n for n, g, _ in calls if n != "broadcast_object_list"],
                "data_on_control": any(g is control for n, g, _ in calls if n != "broadcast_object_list"),
                "data_devices": sorted({d for n, _, d in calls if n != "broadcast_object_list"}),
                "control_backend": dist.get_backend(control),
            }
        # A failure on rank 0 while cutting the rows reaches every rank.
        try:
            scatter_rank_rows(
                full if rank == 0 else None,
                advantages[:3] if rank == 0 else None,
                num_mini_batches=MINI,
                layout=DataLayout.from_megatron(0, 1),
                routed_experts=False,
                device=compute_device(),
            )
            out[f"{layout}/error"] = None
        except Exception as err:
            out[f"{layout}/error"] = type(err).__name__
    out["device"] = str(compute_device())
    Path(args.result, f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    destroy_distributed()


if __name__ == "__main__":
    main()
