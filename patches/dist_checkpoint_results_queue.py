"""megatron's torch_dist writer must not leave a process behind when the trainer is killed.

`FileSystemWriterAsync` collects the results of its writer processes through a queue it gets
from a `multiprocessing.Manager` started with the *spawn* method on the first save: a server
process that lives as long as the trainer and, when the trainer is SIGKILLed (OOM killer,
`kill -9`), is orphaned and lives on forever. Checkpoints here are saved synchronously (the
writer processes are forked from the trainer and report back to it), for which a plain
fork-context queue is enough: no server process, nothing to orphan.
"""

import inspect
import multiprocessing

from packaging.specifiers import SpecifierSet

from ._base import Patch, require


def _check() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    require(
        hasattr(filesystem_async, "_results_queue"),
        "dist_checkpoint_results_queue",
        "filesystem_async._results_queue is gone",
    )
    source = inspect.getsource(filesystem_async._get_write_results_queue)
    require(
        "Manager().Queue()" in source and "_results_queue is None" in source,
        "dist_checkpoint_results_queue",
        "_get_write_results_queue no longer makes a Manager queue once",
    )


def _apply() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = multiprocessing.get_context("fork").Queue()


PATCH = Patch(
    name="dist_checkpoint_results_queue",
    fixes="the first torch_dist save starts a Manager process that a SIGKILLed trainer orphans",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="always",
    check=_check,
    apply=_apply,
)
