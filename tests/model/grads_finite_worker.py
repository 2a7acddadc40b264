"""`grads_are_finite` and `optimizer_step` across ranks: a NaN on one rank refuses the step on all.

    torchrun --nproc_per_node=2 tests/model/grads_finite_worker.py --out O [--ep 2]

Each rank writes `O.rank<r>.json`: per case (which rank holds the NaN: none, 0, 1; in which
buffer: dense or expert), what `grads_are_finite` said on this rank, and whether
`optimizer_step` stepped and left the weights untouched.
"""

import argparse
import json

import torch
import torch.distributed as dist

from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.optim import OptimConfig, build_optimizer, grads_are_finite, optimizer_step, wrap_ddp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ep", type=int, default=1)
    args = parser.parse_args()
    parallel = ParallelConfig(expert_parallel=args.ep)
    init_distributed(parallel, seed=3)
    ddp = wrap_ddp(build_model(tiny(vocab_size=32), parallel))
    optimizer, scheduler = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=1e-2, clip_grad=0.0))
    rank = dist.get_rank()
    out = {}
    for kind, buffers in (("dense", ddp.buffers), ("expert", ddp.expert_parallel_buffers)):
        if not buffers:  # experts sit in the dense buffers when nothing splits them
            continue
        for nan_rank in (None, 0, 1):
            ddp.zero_grad_buffer()
            for buffer in ddp.buffers + ddp.expert_parallel_buffers:
                buffer.grad_data.fill_(0.5)
            if rank == nan_rank:
                grad = buffers[0].grad_data
                grad.view(-1)[grad.numel() // 3] = float("nan")
            finite = grads_are_finite(ddp)
            before = [p.detach().clone() for p in ddp.parameters()]
            stepped, _ = optimizer_step(ddp, optimizer, scheduler)
            unchanged = all(torch.equal(a, p) for a, p in zip(before, ddp.parameters()))
            out[f"{kind}/nan_on_{nan_rank}"] = {"finite": finite, "stepped": stepped, "unchanged": unchanged}
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(out, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
