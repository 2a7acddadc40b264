"""Host memory one rank needs while writing a checkpoint, for `megatron-gspo plan`.

A synchronous `dist_checkpointing` save first copies everything a rank writes into host memory
(megatron's `FileSystemWriterAsync.preload_tensors`), then writes it. Fully parallel saving
spreads replicated tensors over their data-parallel replicas, so each rank writes about
1 / DP of its model-parallel shard's weights and model-space optimizer state.

The distributed optimizer's two formats differ in what else they hold:
- routine (`dp_reshardable`): each rank writes only its own slice of the flat buffers (fp32 main
  param and two Adam moments: 12 bytes per parameter, over DP), nothing gathered;
- reshardable (`fully_reshardable`): every DP rank all-gathers its model-parallel shard's
  whole fp32 state (12 bytes per parameter of the shard) into host memory before writing.
Without the distributed optimizer both are the model-space state, spread over DP.
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZER_STATE_BYTES = 12
"""fp32 main param + Adam's two fp32 moments, per parameter, as the distributed optimizer saves them."""


@dataclass(frozen=True)
class SaveHostMemory:
    """Peak host bytes of one rank during a checkpoint save."""

    routine_bytes: int
    """Routine saves (`trainer.save_every`): this rank's share of what is written."""
    reshardable_bytes: int
    """Reshardable saves (`trainer.reshardable_every`, `trainer.reshardable_at_end`)."""


def save_host_memory(states, parallel, engine, world_size: int) -> SaveHostMemory:
    """Host bytes of one rank while saving, from its `ShardPlan` (`plan.shard_plan`).

    Args:
        states: the rank's `ShardPlan` (dense and expert parameters it holds).
        parallel: the run's `ParallelConfig`.
        engine: the run's `EngineConfig` (weight dtype; Adam's fp32 master copy in bf16).
        world_size: training ranks.
    """
    pp = parallel.pipeline_parallel
    dense_dp = world_size // (parallel.tensor_parallel * pp)
    expert_dp = world_size // (parallel.expert_parallel * parallel.expert_tp * pp)
    dense, expert = states.dense_params, states.expert_params
    share = dense / dense_dp + expert / expert_dp  # parameters whose tensors this rank writes
    weight_size = 2 if engine.dtype == "bf16" else 4
    weights = share * weight_size
    if not parallel.distributed_optimizer:
        adam = 8 + (4 if engine.dtype == "bf16" else 0)  # moments (+ fp32 master params)
        routine = reshardable = weights + share * adam
    else:
        routine = weights + share * OPTIMIZER_STATE_BYTES
        reshardable = weights + (dense + expert) * OPTIMIZER_STATE_BYTES
    return SaveHostMemory(int(routine), int(reshardable))
