"""torchrun as `train --nproc N` and `export --nproc N` start it: a stop signal ends it quietly.

torchrun turns SIGINT / SIGTERM into a `SignalException` that it lets escape as a traceback
after it has stopped the workers, and its rendezvous thread's finalizer then fails at exit
("cannot join current thread"); the workers have already said what was saved. So a stopped
torchrun exits at once, with its own status for a signal, 128 + its number.
"""

import os
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main


def run() -> int:
    """Run torchrun's `main` on this process's arguments; 128 + signal when a signal stopped it."""
    try:
        main()
    except SignalException as stop:  # the workers are stopped and reaped (the agent's shutdown)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + int(stop.sigval))
    return 0


if __name__ == "__main__":
    sys.exit(run())
