"""torchrun as `train --nproc N`, `export --nproc N` and `parity` start it on a CPU machine.

- Its workers are forked from a server that has imported what a rank imports (torch,
  megatron-core, this package: ~7 s of CPU per process on a 2-core box), once per launch rather
  than once per worker. That is torchrun's own `--run-path --start-method forkserver`; this
  module only names the modules the forkserver imports first (`forkserver_preload`). The server is
  a fresh interpreter started by torchrun's agent, so nothing it inherits is initialized: no
  process group, no thread pool, no CUDA context (fork after CUDA would break the workers).
- A stop signal ends it quietly. torchrun turns SIGINT / SIGTERM into a `SignalException` that
  it lets escape as a traceback after it has stopped the workers, and its rendezvous thread's
  finalizer then fails at exit ("cannot join current thread"); the workers have already said
  what was saved. So a stopped torchrun exits at once, with 128 + the signal's number.

GPU nodes run `torchrun ... -m megatron_gspo.cli` directly (launch/train_h100.sh): each
worker is a fresh interpreter there, as torchrun starts a script by default.
"""

import multiprocessing
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main

# `python -m megatron_gspo.cli` as `--run-path` takes it: the module's file, run as `__main__`.
WORKER_CLI = str(Path(__file__).resolve().parents[1] / "cli.py")
PRELOAD = ["megatron_gspo.training.forkserver_preload"]


def forked_workers(nproc: int) -> list[str]:
    """Torchrun's arguments for `nproc` local workers forked from the pre-imported server."""
    return ["--standalone", f"--nproc_per_node={nproc}", "--run-path", "--start-method", "forkserver"]


def run() -> int:
    """Run torchrun's `main` on this process's arguments; 128 + signal when a signal stopped it."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    # A script's workers run `python -u`; forked ones are unbuffered the same way.
    os.environ["PYTHONUNBUFFERED"] = "1"
    try:
        main()
    except SignalException as stop:  # the workers are stopped and reaped (the agent's shutdown)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + int(stop.sigval))
    return 0


if __name__ == "__main__":
    sys.exit(run())
