"""`megatron-gspo plan`: a config checked for a world size, with memory per GPU, without building anything.

- `disaggregated`: the command, and the trainer's per-GPU estimate (shards, activations, sync bytes);
- `colocated`: each phase of a colocated step (generation, training, weight sync) on shared GPUs;
- `checkpoint_memory`: the host memory a checkpoint save needs per rank and per node.
"""

from megatron_gspo.plan.checkpoint_memory import SaveHostMemory, save_host_memory
from megatron_gspo.plan.colocated import colocated_plan
from megatron_gspo.plan.disaggregated import (
    activation_plan,
    add_plan_args,
    micro_batch_shape,
    pipeline_stages,
    run_plan,
    shard_plan,
    sync_bytes,
    sync_sender_bytes,
)

__all__ = [
    "SaveHostMemory",
    "activation_plan",
    "add_plan_args",
    "colocated_plan",
    "micro_batch_shape",
    "pipeline_stages",
    "run_plan",
    "save_host_memory",
    "shard_plan",
    "sync_bytes",
    "sync_sender_bytes",
]
