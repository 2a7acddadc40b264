"""Run one megatron scenario with one runtime patch left out; prints the failure it hits.

    python tests/patches/reproduce.py <patch-name | -> [--tp T --ep E]   (or under torchrun)
    torchrun --nproc_per_node 2 tests/patches/reproduce.py <patch-name | -> --vpp 2   (PP2 x 2 chunks)

Exit status 0 means the scenario ran fine (the patch would no longer be needed); 3 means
it failed, and the exception is printed as `FAILED: <type>: <message>`.
"""

import argparse
import multiprocessing
import sys
import tempfile
import traceback
from pathlib import Path

import torch


def scenario(skip: str, tp: int, ep: int) -> None:
    from megatron_gspo.checkpoint.dist import save_sharded
    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.config import tiny
    from megatron_gspo.model.distributed import ParallelConfig, init_distributed
    from megatron_gspo.model.optim import OptimConfig, build_optimizer, optimizer_step, wrap_ddp
    from megatron_gspo.model.packing import pack_sequences, pad_to_shape, uniform_shape
    from megatron_gspo.model.pipeline import run_micro_batches
    from megatron_gspo.patches import apply_patches

    apply_patches(skip=() if skip == "-" else (skip,))
    parallel = ParallelConfig(tensor_parallel=tp, expert_parallel=ep)
    init_distributed(parallel)
    model = build_model(tiny(vocab_size=64), parallel)
    ddp = wrap_ddp(model, distributed_optimizer=True)
    optimizer, scheduler = build_optimizer(ddp, OptimConfig(lr=1e-3), distributed_optimizer=True)
    seqs = [torch.arange(3, 3 + n) for n in (5, 9, 12, 7)]
    packed = pack_sequences(seqs, pad_multiple=tp)
    packed = pad_to_shape(packed, *uniform_shape(packed))
    # Through megatron's schedule, as every training pass runs.
    run_micro_batches(ddp, [packed], lambda i, logprobs, _: (-logprobs.sum(), {}), forward_only=False)
    optimizer_step(ddp, optimizer, scheduler)
    leaf = optimizer.chained_optimizers[0]
    param = next(iter(leaf.model_param_group_index_map))
    loaded = leaf._get_main_param_and_optimizer_states(param)
    # What loading a `fully_reshardable` checkpoint hands over: no `step` (kept in param groups).
    with torch.no_grad():
        leaf._set_main_param_and_optimizer_states(param, {k: v for k, v in loaded.items() if k != "step"})
    optimizer.load_state_dict(optimizer.state_dict())  # as a resume does
    steps = [s["step"] for opt in optimizer.chained_optimizers for s in opt.optimizer.state.values()]
    if len({id(step) for step in steps}) < len(steps):
        raise AssertionError("Adam step counters are shared between parameters after load_state_dict")
    with tempfile.TemporaryDirectory() as directory:
        save_sharded(Path(directory), ddp, optimizer)
    if any("Manager" in type(p).__name__ or "Manager" in p.name for p in multiprocessing.active_children()):
        raise AssertionError("a checkpoint save left a Manager process running (orphaned by SIGKILL)")


def virtual_pipeline_scenario(skip: str, vpp: int) -> None:
    """Four micro-batches of different lengths, forward and backward, through the interleaved schedule."""
    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.config import tiny
    from megatron_gspo.model.distributed import ParallelConfig, init_distributed
    from megatron_gspo.model.optim import wrap_ddp
    from megatron_gspo.model.packing import pack_sequences
    from megatron_gspo.model.pipeline import run_micro_batches
    from megatron_gspo.patches import apply_patches

    apply_patches(skip=() if skip == "-" else (skip,))
    parallel = ParallelConfig(pipeline_parallel=2, virtual_pipeline=vpp)
    init_distributed(parallel)
    ddp = wrap_ddp(build_model(tiny(vocab_size=64, num_layers=2 * vpp), parallel))
    batches = [pack_sequences([torch.arange(3, 3 + n), torch.arange(5, 5 + n + 2)]) for n in (5, 9, 12, 7)]
    run_micro_batches(ddp, batches, lambda i, logprobs, _: (-logprobs.sum(), {}), forward_only=False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("skip")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None, help="run the virtual-pipeline scenario (PP2)")
    args = parser.parse_args()
    try:
        if args.vpp:
            virtual_pipeline_scenario(args.skip, args.vpp)
        else:
            scenario(args.skip, args.tp, args.ep)
    except Exception as error:  # the point is to report whatever breaks
        traceback.print_exc()
        print(f"FAILED: {type(error).__name__}: {error}", flush=True)
        sys.exit(3)
    print("RAN FINE", flush=True)
