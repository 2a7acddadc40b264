"""Imported by the forkserver that torchrun's workers are forked from (torchrun.py), and only there.

- What every trainer rank imports, imported once. Nothing here may start a thread, a process
  group or a device context, since the workers are forked after it. Being in this package, it is
  imported after the package's `__init__`, which defers megatron-core's import-time compiles.
- The forkserver outlives a stop signal to the job's process group; it ends when torchrun's agent
  does. Were it to die first, the workers, its children, would get SIGINT (torch sets it as their
  parent-death signal) and take a SIGTERM for a Ctrl-C. Each worker gets the default back.
"""

import os
import signal

from megatron.core import dist_checkpointing  # noqa: F401
from megatron.core.distributed import DistributedDataParallel  # noqa: F401
from megatron.core.models.gpt import GPTModel, gpt_layer_specs  # noqa: F401
from megatron.core.optimizer import get_megatron_optimizer  # noqa: F401
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: F401

import megatron_gspo.training.trainer  # noqa: F401

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _default_stop_signals() -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


for _signum in STOP_SIGNALS:
    signal.signal(_signum, signal.SIG_IGN)
os.register_at_fork(after_in_child=_default_stop_signals)
