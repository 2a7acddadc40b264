"""The control plane: a gloo process group for rank 0's results, errors and waits.

Two planes share the processes. The compute plane (forward/backward, gradient and metric
reductions, the per-rank rollout rows) runs on the default group - NCCL on GPUs - with
tensors on `compute_device()`. The control plane carries small Python objects (rank 0's
rollout metadata or exception, eval results, checkpoint decisions) and the barriers around
work only rank 0 does (waiting an hour for rollouts, writing an export). It runs on its own
gloo group, made once at start-up with the run's long timeout, so that

- no pickled object is staged on a GPU (`broadcast_object_list` over NCCL copies it to the
  device of the current rank), and
- ranks idling while rank 0 waits block on a CPU group, not on an NCCL collective whose
  watchdog would abort the job.

Nothing else in the package calls `broadcast_object_list`, `all_gather_object` or
`barrier`; every helper here passes `group=control_group()` explicitly (on CPU the default
group is gloo too, and tests check which group the helpers use).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

_GROUP: dict[str, Any] = {}  # {"world": the default group it was made for, "group": the gloo group}


def init_control_group(timeout_minutes: float) -> None:
    """Make the gloo control group over all ranks (collective; once per default process group).

    Args:
        timeout_minutes: how long a control collective may wait (e.g. for rank 0's rollouts).
    """
    if "group" in _GROUP and _GROUP["world"] is dist.group.WORLD:
        return
    timeout = datetime.timedelta(minutes=timeout_minutes)
    _GROUP["group"] = dist.new_group(backend="gloo", timeout=timeout)
    _GROUP["world"] = dist.group.WORLD


def destroy_control_group() -> None:
    """Forget the control group (torch destroys it with the default process group)."""
    _GROUP.clear()


def control_group() -> dist.ProcessGroup:
    """The gloo control group of the current default process group.

    Raises:
        RuntimeError: torch.distributed was started without `init_distributed`.
    """
    if _GROUP.get("world") is not dist.group.WORLD or "group" not in _GROUP:
        raise RuntimeError(
            "no control group: start torch.distributed with megatron_gspo.model.distributed.init_distributed"
        )
    return _GROUP["group"]


def _multi_rank() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def broadcast_from_rank0(obj: T) -> T:
    """Global rank 0's `obj` on every rank; an exception from rank 0 is raised on every rank."""
    if _multi_rank():
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=control_group())
        obj = box[0]
    if isinstance(obj, BaseException):
        raise obj
    return obj


def broadcast_from(obj: T, src: int) -> T:
    """Global rank `src`'s `obj` on every rank (control plane), e.g. metrics only a later stage has."""
    if _multi_rank():
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=control_group())
        obj = box[0]
    return obj


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in global rank order (control plane)."""
    if not _multi_rank():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj, group=control_group())
    return gathered


def call_on_rank0(fn: Callable[..., T], *args, **kwargs) -> T | BaseException | None:
    """`fn(*args, **kwargs)` on global rank 0 (its exception is returned, not raised); None elsewhere.

    Pair with `broadcast_from_rank0` so every rank learns about a failure instead of hanging.
    """
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # every rank must learn about it, or the others hang
        return err


def on_rank0(fn: Callable[..., T], *args, **kwargs) -> T:
    """Run `fn` on global rank 0 and give its result (or raise its exception) on every rank."""
    return broadcast_from_rank0(call_on_rank0(fn, *args, **kwargs))


def barrier() -> None:
    """Wait for every rank on the control group (e.g. after rank-0-only file writes)."""
    if _multi_rank():
        dist.barrier(group=control_group())
