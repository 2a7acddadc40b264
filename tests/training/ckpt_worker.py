"""Train the tiny run, checkpoint it, and either continue uninterrupted or resume in a new process.

    python ckpt_worker.py full   --root R --out O [--save-at 3 [4 ...]] [--steps 5] [--ep 2] [--distopt]
                                 [--routine]
                                 (--save-at 0: a checkpoint before the first optimizer step;
                                 --routine: layout-bound saves, `reshardable=False`)
    python ckpt_worker.py resume --root R --out O [--steps 5] [--ep 2] [--distopt] [--fallback]
                                 [--routine --resave]

Under torchrun every rank writes `O.rank<r>.pt`: the metrics of the steps after the checkpoint,
one draw from each RNG stream right after the (first) save (full) or the load (resume), the
final global weights and the trainer state at the end. `--fallback` resumes as the trainer's
`--resume` does: from the newest intact checkpoint; `--resave` saves the resumed run once more at
the end and loads that checkpoint back before the weights are taken.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ckpt_common import build_run, draw_probes, train_step  # noqa: E402

from megatron_gspo.checkpoint.dist import optimizer_step_count
from megatron_gspo.checkpoint.load import load_checkpoint
from megatron_gspo.checkpoint.save import save_checkpoint
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed  # noqa: E402
from megatron_gspo.model.sharding import gather_global_state_dict  # noqa: E402


def save(run, args) -> None:
    """Checkpoint `run` at its step into `--root`."""
    save_checkpoint(
        args.root,
        run.step,
        model=run.ddp,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        trainer_state=run.trainer_state(),
        reshardable=not args.routine,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["full", "resume"])
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-at", type=int, nargs="+", default=[3])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--distopt", action="store_true")
    parser.add_argument("--fallback", action="store_true")
    parser.add_argument("--routine", action="store_true")
    parser.add_argument("--resave", action="store_true")
    args = parser.parse_args()
    run = build_run(ParallelConfig(expert_parallel=args.ep, distributed_optimizer=args.distopt))
    metrics, probes = [], None
    if args.mode == "full":
        while True:
            if run.step in args.save_at:  # step 0: before the first optimizer step
                save(run, args)
                if run.step == min(args.save_at):
                    probes = draw_probes()
            if run.step == args.steps:
                break
            step_metrics = train_step(run)
            if run.step > min(args.save_at):
                metrics.append(step_metrics)
    else:
        state = load_checkpoint(
            args.root,
            model=run.ddp,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            fallback=args.fallback,
        )
        probes = draw_probes()
        run.load_trainer_state(state)
        while run.step < args.steps:
            metrics.append(train_step(run))
        if args.resave:
            save(run, args)
            load_checkpoint(args.root, model=run.ddp, optimizer=run.optimizer, scheduler=run.scheduler)
    result = {
        "metrics": metrics,
        "probes": probes,
        "weights": gather_global_state_dict(run.model),
        "trainer_state": run.trainer_state(),
        "loss_std": run.stats.std,
        "optimizer_step": optimizer_step_count(run.optimizer),
    }
    torch.save(result, f"{args.out}.rank{dist.get_rank()}.pt")
    destroy_distributed()


if __name__ == "__main__":
    main()
