"""Save a complete checkpoint at step 1, then block inside the save of step 2 until killed.

    python ckpt_kill_worker.py --root R --reference REF --ready MARKER --point {writing,publish,latest}

`writing`: blocked while the rank file is written (inside pickling the trainer state);
`publish`: all files written and fsynced, blocked just before the directory is renamed;
`latest`: the directory renamed to step_00000002, blocked before `latest` is replaced.
When blocked it creates MARKER; the test then sends SIGKILL. REF receives the global weights
and trainer state of the complete step-1 checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ckpt_common import build_run, train_step  # noqa: E402

from megatron_gspo.checkpoint.save import save_checkpoint
from megatron_gspo.model.distributed import ParallelConfig  # noqa: E402
from megatron_gspo.model.sharding import gather_global_state_dict  # noqa: E402


def block_forever(marker: str) -> None:
    Path(marker).touch()
    while True:
        time.sleep(60)


class BlockWhenPickled:
    """A trainer-state value whose serialisation never finishes (stands in for a slow disk)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        block_forever(self.marker)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--reference", required=True)
    parser.add_argument("--ready", required=True)
    parser.add_argument("--point", choices=["writing", "publish", "latest"], required=True)
    args = parser.parse_args()
    run = build_run(ParallelConfig())
    train_step(run)
    common = dict(model=run.ddp, optimizer=run.optimizer, scheduler=run.scheduler)
    save_checkpoint(args.root, 1, trainer_state=run.trainer_state(), **common)
    torch.save({"weights": gather_global_state_dict(run.model), "state": run.trainer_state()}, args.reference)
    train_step(run)
    state = run.trainer_state()
    if args.point == "writing":
        state["blocker"] = BlockWhenPickled(args.ready)
    else:
        rename, replace = os.rename, os.replace

        def blocking_rename(src, dst):
            if Path(dst).name == "step_00000002":
                block_forever(args.ready)
            return rename(src, dst)

        def blocking_replace(src, dst):
            if Path(dst).name == "latest":
                block_forever(args.ready)
            return replace(src, dst)

        if args.point == "publish":
            os.rename = blocking_rename
        else:
            os.replace = blocking_replace
    save_checkpoint(args.root, 2, trainer_state=state, **common)
    raise SystemExit("save of step 2 returned: the kill point was never reached")


if __name__ == "__main__":
    main()
