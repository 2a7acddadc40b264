"""A checkpoint root's steps: `latest`, the complete step directories, the layout that wrote each.

See the package docstring for the directory layout.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from megatron_gspo.checkpoint.dist import (
    ROUTINE_SHARDING,
    is_distributed_optimizer,
    leaf_optimizers,
)
from megatron_gspo.checkpoint.meta import (
    CheckpointCorruptError,
    CheckpointError,
    read_meta,
    step_dir_name,
    world_rank_size,
)
from megatron_gspo.model.control_plane import all_gather_objects, broadcast_from_rank0

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_TMP_DIR = re.compile(r"^step_\d{8}\.(tmp|old)-[0-9a-f]+$")
_TMP_LATEST = re.compile(r"^\.latest\.tmp-[0-9a-f]+$")


class CheckpointLayoutError(CheckpointError):
    """A routine (layout-bound) checkpoint cannot be loaded at this run's parallel layout."""


# --------------------------------------------------------------------------- layout


def current_layout(optimizer=None) -> dict[str, Any]:
    """The parallel layout of this run, as recorded in (and compared with) `meta.json`."""
    from megatron.core import parallel_state as ps

    _, world = world_rank_size()
    if ps.model_parallel_is_initialized():
        tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
        etp, dp = ps.get_expert_tensor_parallel_world_size(), ps.get_data_parallel_world_size()
        pp = ps.get_pipeline_model_parallel_world_size()
    else:
        tp = ep = etp = dp = pp = 1
    leaves = leaf_optimizers(optimizer) if optimizer is not None else []
    return {
        "world_size": world,
        "tensor_parallel": tp,
        "pipeline_parallel": pp,
        "expert_parallel": ep,
        "expert_tensor_parallel": etp,
        "data_parallel": dp,
        "distributed_optimizer": any(is_distributed_optimizer(o) for o in leaves),
    }


def layout_text(layout: dict[str, Any]) -> str:
    """`world=2 TP=1 PP=1 EP=2 ETP=1 DP=2 distributed_optimizer=True`: a layout as messages name it."""
    return _layout_text(layout)


def _layout_text(layout: dict[str, Any]) -> str:
    return (
        f"world={layout['world_size']} TP={layout['tensor_parallel']} "
        f"PP={layout.get('pipeline_parallel', 1)} EP={layout['expert_parallel']} "
        f"ETP={layout['expert_tensor_parallel']} DP={layout['data_parallel']} "
        f"distributed_optimizer={layout['distributed_optimizer']}"
    )


def _same_layout(meta: dict[str, Any], optimizer) -> bool:
    here = current_layout(optimizer)
    recorded = {"pipeline_parallel": 1, **meta["layout"]}  # checkpoints from before pipeline parallelism
    return {key: recorded.get(key) for key in here} == here


# --------------------------------------------------------------------------- files


def _read_latest_name(root: Path) -> str | None:
    latest = root / LATEST_FILE
    if not latest.exists():
        return None
    name = latest.read_bytes().decode("utf-8", errors="replace").strip()
    if not _STEP_DIR.match(name):
        raise CheckpointCorruptError(f"{latest} names {name!r}, not a step_NNNNNNNN checkpoint directory")
    return name


def latest_step(root: str | os.PathLike) -> int | None:
    """Step of the newest complete checkpoint under `root` (what `latest` names), or None."""
    name = _read_latest_name(Path(root))
    return None if name is None else int(_STEP_DIR.match(name).group(1))


def resumable_step(root: str | os.PathLike) -> int | None:
    """The step a resume starts from before verification, or None when there is none.

    What `latest` names; when `latest` is unreadable, the newest complete directory.
    """
    try:
        return latest_step(root)
    except CheckpointCorruptError:
        return max(list_steps(root), default=None)


def list_steps(root: str | os.PathLike) -> list[int]:
    """Steps of the complete (renamed) checkpoint directories under `root`, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))


def _broadcast(value: Any) -> Any:
    """Rank 0's value everywhere, on the gloo control group (an exception value is returned, not raised)."""
    return broadcast_from_rank0([value])[0]


def _all_gather(value: Any) -> list[Any]:
    return all_gather_objects(value)


def is_reshardable(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint loads at any layout (all but the distributed optimizer's routine saves)."""
    routine = meta.get("optimizer_sharding") == ROUTINE_SHARDING  # absent: written before routine saves
    return not (routine and meta["layout"].get("distributed_optimizer") and meta.get("optimizer_state", True))


def newest_reshardable_step(root: Path, steps: list[int] | None = None) -> int | None:
    """The newest of `steps` (default: every complete one) whose checkpoint loads at any layout."""
    for step in sorted(list_steps(root) if steps is None else steps, reverse=True):
        try:
            if is_reshardable(read_meta(root / step_dir_name(step))):
                return step
        except CheckpointError:
            continue
    return None


def _meta_intact(directory: Path) -> bool:
    try:
        read_meta(directory)
    except CheckpointError:
        return False
    return True
