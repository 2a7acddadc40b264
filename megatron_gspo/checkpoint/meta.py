"""What a checkpoint directory holds and how it is checked: names, meta.json, file verification.

See the `megatron_gspo.checkpoint` package for the layout and the guarantees.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_gspo.checkpoint.files import meta_checksum
from megatron_gspo.checksums import CHECKSUM_ALGORITHM, file_checksum
from megatron_gspo.errors import DiskFullError

META_FILE = "meta.json"
TRAINER_STATE_FILE = "trainer_state.pt"
DIST_DIR = "dist"
MODEL_DIR = "model"
FORMAT_VERSION = 3
READABLE_VERSIONS = (3,)  # 1 and 2 were per-rank, unreshardable shards of the same layout


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or cannot be loaded into this run."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint is missing, incomplete or damaged (as opposed to unloadable into this run)."""


class CheckpointSpaceError(CheckpointError, DiskFullError):
    """A save ran out of disk space; nothing of it was kept and the earlier checkpoints are intact."""


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint of `step` (`step_00000012`)."""
    return f"step_{step:08d}"


def rank_file_name(rank: int) -> str:
    """File name of one rank's RNG streams (`rank_00003.pt`)."""
    return f"rank_{rank:05d}.pt"


def world_rank_size() -> tuple[int, int]:
    """(rank, world size), (0, 1) without torch.distributed."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def my_share(names: list[str]) -> list[str]:
    """The names this rank hashes: every world-size-th one, so all ranks share the reading."""
    rank, world = world_rank_size()
    return names[rank::world]


def dist_share(meta: dict[str, Any]) -> list[str]:
    """This rank's share of the `dist/` files a checkpoint's meta.json lists (to verify on load)."""
    return my_share(sorted(name for name in meta["files"] if name.startswith(f"{DIST_DIR}/")))


def read_meta(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The parsed `meta.json` of one checkpoint directory.

    Raises:
        CheckpointCorruptError: missing, not valid JSON, lacking required fields, or its content
            does not match its own checksum.
        CheckpointError: written in a format version this code cannot read.
    """
    path = Path(checkpoint_dir) / META_FILE
    if not path.exists():
        raise CheckpointCorruptError(f"{path} is missing: {path.parent} is not a complete checkpoint")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"{path} is corrupt (not valid JSON: {exc})") from exc
    required = ("format_version", "step", "layout", "files")
    if not isinstance(meta, dict) or any(key not in meta for key in required):
        have = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointCorruptError(f"{path} is corrupt: needs fields {list(required)}, has {have}")
    # Checked before the version, so a damaged version number is reported as damage.
    if "meta_checksum" in meta and meta["meta_checksum"] != meta_checksum(meta):
        raise CheckpointCorruptError(f"{path} is corrupt: its content does not match its recorded checksum")
    if meta["format_version"] not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: format version {meta['format_version']}, this code reads {list(READABLE_VERSIONS)}"
        )
    sums = meta.get("checksums")
    if (
        "meta_checksum" not in meta
        or not isinstance(sums, dict)
        or sums.get("algorithm") != CHECKSUM_ALGORITHM
        or not isinstance(sums.get("files"), dict)
    ):
        raise CheckpointCorruptError(
            f"{path} is corrupt: needs `meta_checksum` and `checksums` "
            f"({{'algorithm': '{CHECKSUM_ALGORITHM}', 'files': {{name: hex}}}})"
        )
    if "scheduler" not in meta or "optimizer_step" not in meta:
        raise CheckpointCorruptError(f"{path} is corrupt: needs `scheduler` and `optimizer_step`")
    return meta


def verify_files(directory: Path, meta: dict[str, Any], verify: list[str]) -> None:
    """Every listed file present with its recorded size; the files in `verify` also checksummed."""
    world = meta["layout"]["world_size"]
    expected = {rank_file_name(r) for r in range(world)} | {TRAINER_STATE_FILE}
    listed = set(meta["files"])
    dist_files = {name for name in listed if name.startswith(f"{DIST_DIR}/")}
    model_files = {name for name in listed if name.startswith(f"{MODEL_DIR}/")}
    sums = meta["checksums"]["files"]
    if listed - dist_files - model_files != expected or not dist_files or set(sums) != listed:
        raise CheckpointCorruptError(
            f"{directory / META_FILE} lists files {sorted(listed - dist_files)} and "
            f"{len(dist_files)} under {DIST_DIR}/, expected {sorted(expected)} and at least one"
        )
    for name, size in sorted(meta["files"].items()):
        path = directory / name
        if not path.exists():
            raise CheckpointCorruptError(f"{path} is missing (checkpoint written by {world} ranks)")
        if path.stat().st_size != size:
            raise CheckpointCorruptError(
                f"{path} has {path.stat().st_size} bytes, meta.json recorded {size}: truncated"
            )
    for name in verify:
        found = file_checksum(directory / name)
        if found != sums[name]:
            raise CheckpointCorruptError(
                f"{directory / name} is corrupt: its {CHECKSUM_ALGORITHM} is {found[:16]}..., "
                f"meta.json recorded {str(sums[name])[:16]}..."
            )
