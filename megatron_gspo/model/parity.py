"""`megatron-gspo parity`: trust a parallel layout by comparing it with TP=EP=1.

In one world of N ranks, first every rank builds the tiny policy at TP=1, EP=1 (a pure
data-parallel replica fed the whole batch), records per-token log-probs and the weights
after one Adam step on a fixed batch; then megatron's groups are rebuilt for the requested
TP x EP layout, the same global weights are loaded, the batch is split over data-parallel
ranks with a globally normalised loss, and the same step is taken. Rank 0 prints the max
absolute differences; the exit status is non-zero above the tolerance.

On a CPU machine without an outer torchrun, the command re-launches itself under torchrun
with gloo workers; on GPU nodes run it under torchrun directly.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

import torch

DEFAULT_TOLERANCE = 1e-5


def add_parity_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megatron-gspo parity`."""
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size to check")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size to check")
    parser.add_argument("--dispatcher", choices=["alltoall", "allgather"], default="alltoall")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    parser.add_argument("--distributed-optimizer", action="store_true", help="shard Adam states over DP")


def required_world_size(tp: int, ep: int) -> int:
    """Smallest world that holds the layout (expert-TP defaults to TP)."""
    return math.lcm(tp, tp * ep)


def run_parity(args: argparse.Namespace) -> int:
    """Entry point: re-launch under torchrun on CPU if needed, else run the check."""
    world = required_world_size(args.tp, args.ep)
    if "RANK" not in os.environ and world > 1:
        if torch.cuda.is_available():
            print(f"run under torchrun with {world} (or a multiple of {world}) GPUs", file=sys.stderr)
            return 2
        return _relaunch_on_cpu(world)
    return _check(args)


def _relaunch_on_cpu(world: int) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        "-m",
        "megatron_gspo.cli",
        *sys.argv[1:],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, env=env)


def _batch(vocab_size: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Eight samples of varied length; the second half of each is the 'response'."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 40, (8,), generator=gen).tolist()
    seqs = [torch.randint(3, vocab_size, (n,), generator=gen) for n in lengths]
    masks = [torch.arange(n) >= n // 2 for n in lengths]
    return seqs, masks


def _one_step(model_cfg, parallel, seqs, masks, weights, args):
    """Build, load weights, log-probs of every sample, one Adam step on this DP rank's share."""
    from megatron.core import parallel_state as ps

    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.distributed import init_distributed
    from megatron_gspo.model.logprobs import sequence_logprobs
    from megatron_gspo.model.optim import (
        OptimConfig,
        build_optimizer,
        dp_loss_scale,
        optimizer_step,
        wrap_ddp,
        zero_grads,
    )
    from megatron_gspo.model.sharding import gather_global_state_dict, load_global_state_dict

    init_distributed(parallel, seed=args.seed)
    model = build_model(model_cfg, parallel)
    if weights is not None:
        load_global_state_dict(model, weights)
    initial = gather_global_state_dict(model)
    ddp = wrap_ddp(model, distributed_optimizer=parallel.distributed_optimizer)
    optimizer, scheduler = build_optimizer(
        ddp, OptimConfig(lr=1e-3, clip_grad=1.0), distributed_optimizer=parallel.distributed_optimizer
    )
    tp = parallel.tensor_parallel
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(ddp, seqs, pad_multiple=tp)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = list(range(dp_rank, len(seqs), dp))
    total_tokens = sum(int(m[1:].sum()) for m in masks)
    zero_grads(ddp, optimizer)
    local_logprobs, _ = sequence_logprobs(ddp, [seqs[i] for i in mine], pad_multiple=tp)
    local_mask = torch.zeros_like(local_logprobs)
    for row, i in enumerate(mine):
        local_mask[row, : len(masks[i])] = masks[i].float()
    local_mask[:, 0] = 0.0
    loss = -(local_logprobs * local_mask).sum() / total_tokens * dp_loss_scale()
    loss.backward()
    stepped, grad_norm = optimizer_step(ddp, optimizer, scheduler)
    if not stepped:
        raise RuntimeError("parity: the optimizer step was skipped (non-finite gradients)")
    return initial, logprobs, gather_global_state_dict(model), grad_norm


def _check(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from megatron_gspo.model import config as model_configs
    from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed

    model_cfg = model_configs.tiny(vocab_size=96)
    seqs, masks = _batch(model_cfg.vocab_size, args.seed)
    reference = ParallelConfig(token_dispatcher=args.dispatcher)
    weights, ref_logprobs, ref_updated, ref_norm = _one_step(model_cfg, reference, seqs, masks, None, args)
    layout = ParallelConfig(
        tensor_parallel=args.tp,
        expert_parallel=args.ep,
        token_dispatcher=args.dispatcher,
        distributed_optimizer=args.distributed_optimizer,
    )
    _, logprobs, updated, grad_norm = _one_step(model_cfg, layout, seqs, masks, weights, args)
    logprob_diff = (logprobs - ref_logprobs).abs().max().item()
    weight_diff = max((updated[k] - ref_updated[k]).abs().max().item() for k in ref_updated)
    ok = max(logprob_diff, weight_diff, abs(grad_norm - ref_norm)) <= args.tolerance
    if dist.get_rank() == 0:
        verdict = "OK" if ok else "FAIL"
        print(
            f"parity tp={args.tp} ep={args.ep} dispatcher={args.dispatcher} world={dist.get_world_size()} "
            f"vs tp=1 ep=1: max|dlogprob|={logprob_diff:.3e} "
            f"max|dweight| after one Adam step={weight_diff:.3e} "
            f"grad_norm {grad_norm:.6f} vs {ref_norm:.6f} -> {verdict} (tolerance {args.tolerance:g})",
            flush=True,
        )
    destroy_distributed()
    return 0 if ok else 1
