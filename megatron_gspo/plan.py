"""`megatron-gspo plan`: dry-run a run config for a cluster without building anything.

Validates the config for a world size exactly as `train` would, then prints how the
policy is sharded and a per-GPU memory estimate of the model states (weights, fp32 grad
buffers, optimizer states) so a layout for H100 nodes can be checked on a laptop or in CI.
Activations, the KV cache of colocated engines and allocator overhead are not included:
keep a margin (`--activation-headroom-gb`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GIB = 1024**3


@dataclass
class ShardPlan:
    """Parameters and model-state bytes held by one rank."""

    dense_params: int
    expert_params: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        """Weights + grads + optimizer states."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


def shard_plan(model, parallel, engine, world_size: int) -> ShardPlan:
    """Per-rank model-state estimate for `MoEModelConfig` x `ParallelConfig` x `EngineConfig`.

    Dense parameters (attention, norms, router, embeddings) are split over TP; expert
    parameters over EP x expert-TP. Grad buffers are fp32. Adam keeps two fp32 moments, plus
    an fp32 master copy when training in bf16; the distributed optimizer shards these over
    the data-parallel replicas of each parameter (world / TP for dense, world / (EP x ETP) for
    experts).
    """
    expert = model.num_layers * model.num_experts * 3 * model.hidden_size * model.moe_ffn_hidden_size
    dense = model.num_parameters - expert
    tp, ep, etp = parallel.tensor_parallel, parallel.expert_parallel, parallel.expert_tp
    dense_local, expert_local = dense // tp, expert // (ep * etp)
    weight_size = 2 if engine.dtype == "bf16" else 4
    optimizer_size = 8 + (4 if engine.dtype == "bf16" else 0)
    dense_dp, expert_dp = world_size // tp, world_size // (ep * etp)
    if parallel.distributed_optimizer:
        optimizer = dense_local * optimizer_size / dense_dp + expert_local * optimizer_size / expert_dp
    else:
        optimizer = (dense_local + expert_local) * optimizer_size
    return ShardPlan(
        dense_params=dense_local,
        expert_params=expert_local,
        weight_bytes=(dense_local + expert_local) * weight_size,
        grad_bytes=(dense_local + expert_local) * 4,
        optimizer_bytes=int(optimizer),
    )


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megatron-gspo plan`."""
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--world-size", type=int, required=True, help="training ranks (GPUs)")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU (H100: 80)")
    parser.add_argument(
        "--activation-headroom-gb", type=float, default=20.0, help="kept free for activations"
    )
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. parallel.expert_parallel=8")


def run_plan(args: argparse.Namespace) -> int:
    """Validate and print the plan; non-zero exit when the model states do not fit."""
    from megatron_gspo.config import build_model_config, load_config, validate

    cfg = load_config(args.config, args.overrides)
    validate(cfg, world_size=args.world_size)
    model = build_model_config(cfg)
    plan = shard_plan(model, cfg.parallel, cfg.engine, args.world_size)
    budget = (args.gpu_memory_gb - args.activation_headroom_gb) * GIB
    p = cfg.parallel
    shape = f"{model.num_layers} layers, {model.num_experts} experts top-{model.moe_topk}"
    print(
        f"{args.config}: {model.num_parameters / 1e9:.1f}B parameters ({shape}) on {args.world_size} ranks: "
        f"TP={p.tensor_parallel} EP={p.expert_parallel} ETP={p.expert_tp} "
        f"DP={args.world_size // p.tensor_parallel} SP={p.use_sequence_parallel} "
        f"distributed optimizer={p.distributed_optimizer} dtype={cfg.engine.dtype}"
    )
    print(
        f"per rank: {plan.dense_params / 1e6:.0f}M dense + {plan.expert_params / 1e6:.0f}M expert params; "
        f"weights {plan.weight_bytes / GIB:.1f} GiB, grads {plan.grad_bytes / GIB:.1f} GiB, "
        f"optimizer {plan.optimizer_bytes / GIB:.1f} GiB = {plan.total_bytes / GIB:.1f} GiB "
        f"(budget {budget / GIB:.0f} GiB = {args.gpu_memory_gb:g} - {args.activation_headroom_gb:g} headroom)"
    )
    fits = plan.total_bytes <= budget
    print(
        "fits"
        if fits
        else "DOES NOT FIT: raise expert_parallel / tensor_parallel or use the distributed optimizer"
    )
    return 0 if fits else 1
