"""Save a checkpoint at one parallel layout, or load it at another; dump what must agree.

    python reshard_worker.py save --root R --out O --tp 2 [--ep 1] [--pp 1] [--distopt] [--steps 2]
        [--vpp 2 --layers 4]   (model chunks per stage; the tiny model's layers)
        [--first-root R0]      (also a checkpoint before the first optimizer step, dumped to O_step0.pt)
    python reshard_worker.py load --root R --out O --tp 1 --ep 2 [--distopt]   (or under torchrun)

`save` trains `--steps` steps (two; 0: a checkpoint before the first optimizer step) and
checkpoints; `load` resumes from it. Both then write on rank 0
`O.pt`: the global weights, the global Adam moments (gathered with the sharding code, not with
`dist_checkpointing`; plain optimizer only), Adam's step count, per-token log-probs of a fixed
batch, the same log-probs from the checkpointed weights loaded through
`sharding.load_global_state_dict` into a fresh model of this layout (`--reference W`), and the
weights after one more optimizer step on a fixed batch. Log-probs and that step go through
megatron's schedule (`model.pipeline.run_micro_batches`), so any pipeline layout runs them.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ckpt_common import build_run, load_run, packed_batch, save_run, train_step  # noqa: E402

from megatron_gspo.checkpoint.dist import leaf_optimizers, optimizer_step_count  # noqa: E402
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed  # noqa: E402
from megatron_gspo.model.optim import dp_loss_scale, optimizer_step, zero_grads  # noqa: E402
from megatron_gspo.model.pipeline import run_micro_batches, share_from_last_stage  # noqa: E402
from megatron_gspo.model.sharding import gather_global_state_dict, load_global_state_dict  # noqa: E402

VOCAB = 80  # divisible by TP=2


def fixed_batch() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in (9, 14, 6, 11)]


def logprobs(run) -> torch.Tensor:
    """Per-token log-probs [B, T] of `fixed_batch`, on every rank (the last stage computes them)."""
    kept = {}

    def keep(i, logprobs, entropy):
        kept["logprobs"] = logprobs.detach().cpu()
        return logprobs.sum() * 0, {}

    with torch.no_grad():
        run_micro_batches(run.ddp, [packed_batch(run.ddp, fixed_batch())], keep, forward_only=True)
    return share_from_last_stage(kept.get("logprobs"))


def global_moments(run) -> dict[str, dict[str, torch.Tensor]]:
    """exp_avg / exp_avg_sq of every parameter as global tensors (plain optimizer: param-shaped)."""
    state = {}
    for leaf in leaf_optimizers(run.optimizer):
        for group in leaf.optimizer.param_groups:
            for param in group["params"]:
                state[param] = leaf.optimizer.state[param]
    out = {}
    for key in ("exp_avg", "exp_avg_sq"):
        kept = {param: param.data for param in state}
        try:
            for param, entry in state.items():
                param.data = entry[key]  # the sharding code gathers parameters: show it the moments
            out[key] = gather_global_state_dict(run.model)
        finally:
            for param, data in kept.items():
                param.data = data
    return out


def fixed_step(run) -> None:
    """One optimizer step on `fixed_batch`, split over DP ranks with a global normaliser."""
    from megatron.core import parallel_state as ps

    seqs = fixed_batch()
    mine = list(range(ps.get_data_parallel_rank(), len(seqs), ps.get_data_parallel_world_size()))
    zero_grads(run.ddp, run.optimizer)
    total = sum(len(s) - 1 for s in seqs)

    def loss(i, local, entropy):
        return -local.sum() / total * dp_loss_scale(), {}

    run_micro_batches(run.ddp, [packed_batch(run.ddp, [seqs[i] for i in mine])], loss, forward_only=False)
    stepped, _ = optimizer_step(run.ddp, run.optimizer, run.scheduler)
    assert stepped


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, help="model chunks per pipeline stage (virtual pipeline)")
    parser.add_argument("--layers", type=int, help="the tiny model's layers (default: its own)")
    parser.add_argument("--distopt", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--reference", help="global weights to load through the sharding code")
    parser.add_argument("--first-root", help="save: also checkpoint here before the first step")
    args = parser.parse_args()
    parallel = ParallelConfig(
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        expert_parallel=args.ep,
        virtual_pipeline=args.vpp,
        distributed_optimizer=args.distopt,
    )
    run = build_run(parallel, vocab_size=VOCAB, num_layers=args.layers)
    if args.mode == "save":
        if args.first_root:  # what a `--steps 0` run saves and dumps, from the same process
            save_run(run, args.first_root)
            first = {"weights": gather_global_state_dict(run.model), "logprobs": logprobs(run)}
            first.update(adam_step=optimizer_step_count(run.optimizer), trainer_step=run.step)
            first["scheduler_steps"] = run.scheduler.num_steps
            if dist.get_rank() == 0:
                torch.save(first, f"{args.out}_step0.pt")
        for _ in range(args.steps):
            train_step(run)
        save_run(run, args.root)
    else:
        run.load_trainer_state(load_run(run, args.root))
    result = {
        "weights": gather_global_state_dict(run.model),
        "moments": None if args.distopt or run.step == 0 else global_moments(run),
        "adam_step": optimizer_step_count(run.optimizer),
        "scheduler_steps": run.scheduler.num_steps,
        "logprobs": logprobs(run),
        "trainer_step": run.step,
    }
    if args.reference:
        fresh = build_run(parallel, init=False, vocab_size=VOCAB, num_layers=args.layers)
        load_global_state_dict(fresh.model, torch.load(args.reference, weights_only=True))
        result["reference_logprobs"] = logprobs(fresh)
    fixed_step(run)
    result["weights_after_step"] = gather_global_state_dict(run.model)
    if dist.get_rank() == 0:
        torch.save(result, f"{args.out}.pt")
    destroy_distributed()


if __name__ == "__main__":
    main()
