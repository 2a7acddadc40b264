"""`plan --placement colocated`: per-GPU peaks of each phase when trainer and SGLang share the GPUs.

Two processes share each GPU, and neither can use what the other holds reserved: SGLang's memory
saver frees its weights and KV cache but keeps a remainder (CUDA context, graph buffers:
`--server-remainder-gb`), and the trainer, after parking its state and `torch.cuda.empty_cache()`,
keeps its own (CUDA context, NCCL buffers, what was never parked: `--trainer-remainder-gb`). Both
remainders and the reserve are in every phase. Phases of a colocated run
(`placement/colocation.py`), each one's peak per GPU:

- start-up: the servers, launched first, hold their weights and KV cache (SGLang's static pool)
  while the trainer builds its full model states, runs the cold start's SFT (its activations)
  and the start-up weight sync (its buffers), before its first hand-over parks them;
- generation: SGLang's weights (the whole model over `rollout.server_tensor_parallel` ranks)
  + its KV cache + the trainer's remainder (its parameters and optimizer state parked in host
  memory, its gradients dropped, the freed memory handed back to the driver);
- training: the trainer's model states (the optimizer's share in host memory with
  `optim.optimizer_cpu_offload`) + one micro-batch's activations + SGLang's remainder;
- weight sync: SGLang's weights resumed + the trainer's parameters, which the sync reads (its
  gradients and optimizer state parked; the parameters follow once sent) + the sync buffers
  (every rank holds them, handing its own copy to the server rank on its GPU);
- checkpoint save: the trainer's model states brought back beside SGLang's weights (the servers
  are idle and free their KV cache for the save, `Colocated.state_on_device`).

The largest decides; a layout over the GPU is refused by name, with its phase. Host memory is
counted as torch's pinned allocator takes it: each parked buffer rounded up to a power of two.
"""

from __future__ import annotations

import argparse

from megatron_gspo.placement.offload import pinned_host_bytes

GIB = 1024**3


def add_colocated_args(parser: argparse.ArgumentParser) -> None:
    """`plan`'s arguments of the colocated estimate."""
    parser.add_argument(
        "--placement",
        choices=("config", "colocated", "disaggregated"),
        default="config",
        help="estimate for this rollout placement (config: the config's rollout.placement)",
    )
    parser.add_argument(
        "--kv-cache-gb", type=float, default=16.0, help="SGLang's KV cache per GPU (colocated)"
    )
    parser.add_argument(
        "--server-remainder-gb",
        type=float,
        default=2.0,
        help="what an SGLang rank keeps after releasing weights and KV cache (context, graphs)",
    )
    parser.add_argument(
        "--trainer-remainder-gb",
        type=float,
        default=2.0,
        help="what a trainer rank keeps reserved with its state parked (CUDA context, NCCL buffers)",
    )


def trainer_state_bytes(states, optim) -> int:
    """The trainer's model states on the GPU while it trains (the host-stepped optimizer share left out)."""
    on_gpu = 1.0 - (optim.optimizer_offload_fraction if optim.optimizer_cpu_offload else 0.0)
    return (
        states.weight_bytes
        + states.grad_bytes
        + int(states.optimizer_bytes * on_gpu)
        + states.reference_bytes
    )


def parked_host_bytes(states, optim) -> int:
    """Pinned host memory of a rank's parked state, as the pinned allocator rounds it.

    DDP's two weight buffers (dense, expert) are one block each; the optimizer's share on the GPU
    is one block per state tensor, counted at the rounding's worst (2x). Gradients are dropped,
    not parked; a host-stepped optimizer share stays where it is.
    """
    per_param = states.weight_bytes / max(states.dense_params + states.expert_params, 1)
    weights = sum(pinned_host_bytes(int(n * per_param)) for n in (states.dense_params, states.expert_params))
    on_gpu = 1.0 - (optim.optimizer_offload_fraction if optim.optimizer_cpu_offload else 0.0)
    return weights + 2 * int(states.optimizer_bytes * on_gpu)


def colocated_phases(args, cfg, model, states, activation_bytes: int, sender_bytes: int) -> dict[str, int]:
    """Each phase's peak bytes per GPU, both processes' remainders and the reserve included."""
    dtype_size = 2 if cfg.rollout.dtype == "bf16" or cfg.engine.dtype == "bf16" else 4
    server_weights = model.num_parameters * dtype_size // cfg.rollout.server_tensor_parallel
    kv, reserve = args.kv_cache_gb * GIB, args.reserve_gb * GIB
    always = (args.server_remainder_gb + args.trainer_remainder_gb) * GIB + reserve
    trainer = trainer_state_bytes(states, cfg.optim)
    cold_start = activation_bytes if cfg.sft.steps > 0 else 0
    return {
        "start-up": server_weights + kv + trainer + max(cold_start, sender_bytes) + always,
        "generation": server_weights + kv + always,
        "training": trainer + activation_bytes + always,
        "weight sync": server_weights + states.weight_bytes + sender_bytes + always,
        "checkpoint save": server_weights + trainer + always,
    }


def colocated_plan(args, cfg, model, states, activation_bytes: int, sender_bytes: int) -> int:
    """Print each phase's per-GPU peak; 0 when the largest fits, 1 (refused by phase) otherwise."""
    dtype_size = 2 if cfg.rollout.dtype == "bf16" or cfg.engine.dtype == "bf16" else 4
    server_weights = model.num_parameters * dtype_size // cfg.rollout.server_tensor_parallel
    kv = args.kv_cache_gb * GIB
    trainer = trainer_state_bytes(states, cfg.optim)
    phases = colocated_phases(args, cfg, model, states, activation_bytes, sender_bytes)
    host = parked_host_bytes(states, cfg.optim)
    print(
        f"colocated (rollout.server_tensor_parallel={cfg.rollout.server_tensor_parallel}): SGLang weights "
        f"{server_weights / GIB:.1f} GiB + KV cache {args.kv_cache_gb:g} GiB per GPU; trainer model "
        f"states on the GPU while training {trainer / GIB:.1f} GiB"
        + (
            f" (optimizer {states.optimizer_bytes / GIB:.1f} GiB x {cfg.optim.optimizer_offload_fraction:g} "
            "stepped on the host: optim.optimizer_cpu_offload)"
            if cfg.optim.optimizer_cpu_offload
            else ""
        )
        + f"; parked in pinned host memory during generation: {host / GIB:.1f} GiB per rank "
        "(power-of-two blocks; gradients dropped)"
    )
    for phase, peak in phases.items():
        print(
            f"phase {phase}: peak {peak / GIB:.1f} GiB per GPU (SGLang's remainder "
            f"{args.server_remainder_gb:g}, the trainer's {args.trainer_remainder_gb:g} and the reserve "
            f"{args.reserve_gb:g} included)"
        )
    # SGLang sizes its static pool (weights + KV cache) as this share of the GPU's memory.
    fraction = (server_weights + kv) / (args.gpu_memory_gb * GIB)
    print(
        f"SGLang: --mem-fraction-static {fraction:.2f} holds these weights and a {args.kv_cache_gb:g} GiB "
        f"KV cache (launch/sglang_servers.sh: MEM_FRACTION={fraction:.2f})"
    )
    if cfg.weight_sync.method == "tensor":
        print(
            "weight sync by CUDA IPC tensor handles: each bucket is allocated with expandable segments "
            "off and they are switched back on after it (weight_sync/ipc_allocation.py): memory in an "
            "expandable segment is shared as a file descriptor an SGLang server may not fetch "
            "(pidfd_getfd), so PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True holds for the rest"
        )
    phase, peak = max(phases.items(), key=lambda item: item[1])
    over = peak - args.gpu_memory_gb * GIB
    if over <= 0:
        print(f"colocated fits: the {phase} phase decides ({-over / GIB:.1f} GiB to spare)")
        return 0
    levers = {
        "start-up": "lower --kv-cache-gb",
        "generation": "lower --kv-cache-gb",
        "training": "lower trainer.max_tokens_per_micro_batch",
        "weight sync": "lower weight_sync.bucket_mb",
    }
    print(
        f"DOES NOT FIT (colocated, {phase} phase): {peak / GIB:.1f} GiB is {over / GIB:.1f} GiB over the "
        f"{args.gpu_memory_gb:g} GiB GPU; raise expert_parallel / rollout.server_tensor_parallel, set "
        f"optim.optimizer_cpu_offload" + (f", {levers[phase]}" if phase in levers else "")
    )
    return 1
