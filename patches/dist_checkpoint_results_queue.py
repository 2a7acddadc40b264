"""megatron's torch_dist writer must not leave a process behind when the trainer is killed.

`FileSystemWriterAsync` collects the results of its writer processes through a queue it gets
from a `multiprocessing.Manager` started with the *spawn* method on the first save: a server
process that lives as long as the trainer and, when the trainer is SIGKILLed (OOM killer,
`kill -9`), is orphaned and lives on forever. Checkpoints here are saved synchronously: the
trainer process itself collects its forked writers' results and puts them on that queue,
and reads them back right after, so an in-process queue is enough (no server process,
nothing to orphan). Not for megatron's async save, whose background process would need the
Manager queue; this project does not use it.
"""

import inspect
import queue

from packaging.specifiers import SpecifierSet

from ._base import Patch, require


def _check() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    require(
        hasattr(filesystem_async, "_results_queue"),
        "dist_checkpoint_results_queue",
        "filesystem_async._results_queue is gone",
    )
    # `_get_write_results_queue` in 0.16, `get_write_results_queue` in 0.19.
    getter = getattr(filesystem_async, "_get_write_results_queue", None) or getattr(
        filesystem_async, "get_write_results_queue", None
    )
    require(getter is not None, "dist_checkpoint_results_queue", "the results-queue getter is gone")
    source = inspect.getsource(getter)
    require(
        "Manager().Queue()" in source and "_results_queue is None" in source,
        "dist_checkpoint_results_queue",
        "the results-queue getter no longer makes a Manager queue once",
    )


def _apply() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()  # put and get_nowait in the trainer process


PATCH = Patch(
    name="dist_checkpoint_results_queue",
    fixes="the first torch_dist save starts a Manager process that a SIGKILLed trainer orphans",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="always",
    check=_check,
    apply=_apply,
)
