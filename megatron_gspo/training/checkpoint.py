"""Training checkpoints: save and resume a run exactly, atomically, one file per rank.

Layout of a checkpoint root::

    root/
      latest                  name of the newest complete checkpoint directory (one line)
      step_00000003/
        meta.json             step, weight_version, parallel layout, versions, file sizes and
                              SHA-256 checksums, and a checksum of meta.json itself
        trainer_state.pt      the trainer's own state (data position, running stats, counters, config)
        rank_00000.pt         this rank's model shard, optimizer, scheduler and RNG states
        rank_00001.pt
        ...

Every rank writes only its own shard (no gather), so the format is tied to the parallel
layout it was written with: loading checks that tensor / expert / expert-tensor parallel
sizes, the world size and the optimizer kind all match, and refuses otherwise. To move a
policy to another layout, export global weights (`megatron_gspo.model.sharding` /
`hf_checkpoint`) and start a new run from them.

Atomicity: all ranks write into a fresh `step_N.tmp-<random>/` directory and fsync their
files; once every rank has succeeded, rank 0 renames the directory to `step_N/` and then
replaces `latest` through a temporary file and `os.replace`. A crash at any point leaves
`latest` naming either the previous complete checkpoint or the new one; directories a crash
left behind are removed by the next save.

Integrity: each file's checksum is computed while it is written and recorded in `meta.json`.
Loading verifies the files every rank reads (each rank its own shard, rank 0 also the trainer
state) and names a damaged file. With `fallback=True` (what `--resume` uses) a damaged
checkpoint is skipped with a warning for the newest older intact one, and `latest` is pointed
at it; only when none is intact does loading fail, listing what was wrong with each.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_gspo.model.control_plane import all_gather_objects, broadcast_from_rank0
from megatron_gspo.training.checkpoint_files import (
    CHECKSUM_ALGORITHM,
    file_checksum,
    fsync_dir,
    meta_checksum,
    save_durably,
    write_meta,
    write_text_atomically,
)

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
META_FILE = "meta.json"
TRAINER_STATE_FILE = "trainer_state.pt"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # version 1: no checksums (sizes are still checked)
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_TMP_DIR = re.compile(r"^step_\d{8}\.(tmp|old)-[0-9a-f]+$")
_TMP_LATEST = re.compile(r"^\.latest\.tmp-[0-9a-f]+$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or was written for another layout."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint is missing, incomplete or damaged (as opposed to written for another layout)."""


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint of `step` (`step_00000012`)."""
    return f"step_{step:08d}"


def rank_file_name(rank: int) -> str:
    """File name of one rank's shard (`rank_00003.pt`)."""
    return f"rank_{rank:05d}.pt"


# --------------------------------------------------------------------------- RNG


def capture_rng_state() -> dict[str, Any]:
    """Every random stream a training step can draw from, on this rank.

    Returns:
        `python` (random.getstate()), `numpy` (legacy global generator state), `torch_cpu`
        (ByteTensor), `cuda` (one ByteTensor per device, only with CUDA) and `megatron_tracker`
        (megatron's model-parallel RNG tracker: name -> generator state; empty when unused).
    """
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "megatron_tracker": {name: s.clone() for name, s in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what `capture_rng_state` returned, so the next draws repeat exactly.

    Raises:
        ValueError: a stream is missing, or the state holds CUDA generators and CUDA is absent.
    """
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    missing = {"python", "numpy", "torch_cpu", "megatron_tracker"} - set(state)
    if missing:
        raise ValueError(f"RNG state lacks {sorted(missing)} (has {sorted(state)})")
    if "cuda" in state and not torch.cuda.is_available():
        raise ValueError("RNG state holds CUDA generator states but CUDA is not available here")
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = get_cuda_rng_tracker()
    if state["megatron_tracker"] or tracker.get_states():
        tracker.set_states({name: s.clone() for name, s in state["megatron_tracker"].items()})


# --------------------------------------------------------------------------- layout


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _leaf_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed_optimizer(leaf) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(leaf, DistributedOptimizer)


def current_layout(optimizer=None) -> dict[str, Any]:
    """The parallel layout of this run, as recorded in (and checked against) `meta.json`."""
    from megatron.core import parallel_state as ps

    _, world = _world()
    if ps.model_parallel_is_initialized():
        tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
        etp, dp = ps.get_expert_tensor_parallel_world_size(), ps.get_data_parallel_world_size()
    else:
        tp = ep = etp = dp = 1
    leaves = _leaf_optimizers(optimizer) if optimizer is not None else []
    return {
        "world_size": world,
        "tensor_parallel": tp,
        "expert_parallel": ep,
        "expert_tensor_parallel": etp,
        "data_parallel": dp,
        "distributed_optimizer": any(_is_distributed_optimizer(o) for o in leaves),
    }


def _layout_text(layout: dict[str, Any]) -> str:
    return (
        f"world={layout['world_size']} TP={layout['tensor_parallel']} EP={layout['expert_parallel']} "
        f"ETP={layout['expert_tensor_parallel']} DP={layout['data_parallel']} "
        f"distributed_optimizer={layout['distributed_optimizer']}"
    )


# --------------------------------------------------------------------------- optimizer state


def _optimizer_state(optimizer) -> list[dict[str, Any]]:
    """Per leaf optimizer: its state_dict, plus this DP rank's parameter shard if distributed."""
    states = []
    for leaf in _leaf_optimizers(optimizer):
        entry: dict[str, Any] = {"state_dict": leaf.state_dict()}
        if _is_distributed_optimizer(leaf):
            # This rank's own shard of main params and Adam moments, in bucket order: no gather,
            # valid for exactly this layout (which loading enforces).
            shard = leaf.get_parameter_state_dp_reshardable()
            for key, per_dtype in shard.items():
                if isinstance(key, int):
                    for buckets in per_dtype.values():
                        for bucket in buckets:
                            for i, tensors in enumerate(bucket):
                                bucket[i] = {
                                    k: v.detach().clone() if torch.is_tensor(v) else v
                                    for k, v in tensors.items()
                                } | {"padding": False}
            entry["parameter_shard"] = shard
        states.append(entry)
    return states


def _load_optimizer_state(optimizer, states: list[dict[str, Any]], path: Path) -> None:
    leaves = _leaf_optimizers(optimizer)
    if len(leaves) != len(states):
        raise CheckpointError(f"{path}: holds {len(states)} optimizer(s), this run has {len(leaves)}")
    for leaf, entry in zip(leaves, states):
        leaf.load_state_dict(entry["state_dict"])
        if _is_distributed_optimizer(leaf):
            with torch.no_grad():  # copies into main params, which are views of leaf parameters
                leaf.load_parameter_state_from_dp_reshardable(entry["parameter_shard"])


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


# --------------------------------------------------------------------------- save


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer,
    scheduler,
    trainer_state: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Write the checkpoint of `step` atomically and make it `latest` (collective: every rank calls it).

    Args:
        root: checkpoint root directory (created if needed; shared by all ranks).
        step: the optimizer step just completed.
        model: this rank's model shard (DDP-wrapped or bare; its `state_dict()` is stored).
        optimizer: the megatron optimizer (`get_megatron_optimizer`), distributed or not.
        scheduler: megatron's `OptimizerParamScheduler`.
        trainer_state: the trainer's own state (data position, running statistics, counters,
            config dump, `weight_version`), torch-serialisable; stored once, by rank 0.
        keep_last: complete checkpoints to keep (the newest ones up to `step`); older ones are
            deleted after the new one is in place.

    Returns:
        The final checkpoint directory `root/step_NNNNNNNN`.

    Raises:
        ValueError: bad `step` / `keep_last` / `trainer_state`.
        CheckpointError: `step` is already the latest checkpoint, or a rank failed to write.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if not isinstance(trainer_state, dict):
        raise ValueError(f"trainer_state must be a dict, got {type(trainer_state).__name__}")
    root = Path(root)
    rank, world = _world()
    final = root / step_dir_name(step)

    error = None
    tmp_name = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if _read_latest_name(root) == final.name:
                raise CheckpointError(f"{final} is already the latest checkpoint; refusing to overwrite it")
            _remove_stale(root)
            tmp_name = f"{final.name}.tmp-{secrets.token_hex(6)}"
            (root / tmp_name).mkdir()
        except Exception as exc:  # reported on every rank below
            error = f"rank 0 could not prepare {root}: {exc}"
    error, tmp_name = _broadcast((error, tmp_name))
    if error:
        raise CheckpointError(error)
    tmp = root / tmp_name

    files: dict[str, tuple[int, str]] = {}  # name -> (bytes, checksum)
    failure = None
    try:
        shard = {
            "format_version": FORMAT_VERSION,
            "rank": rank,
            "model": model.state_dict(),
            "optimizer": _optimizer_state(optimizer),
            "scheduler": scheduler.state_dict(),
            "rng": capture_rng_state(),
        }
        files[rank_file_name(rank)] = save_durably(shard, tmp / rank_file_name(rank))
        if rank == 0:
            files[TRAINER_STATE_FILE] = save_durably(trainer_state, tmp / TRAINER_STATE_FILE)
    except Exception as exc:
        failure = f"rank {rank}: {type(exc).__name__}: {exc}"
    failures = [f for f in _all_gather(failure) if f]
    all_files = {k: v for f in _all_gather(files) for k, v in f.items()}
    if failures:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving step {step} to {root} failed: " + "; ".join(failures))

    if rank == 0:
        try:
            write_meta(tmp / META_FILE, _meta(step, optimizer, trainer_state, all_files))
            fsync_dir(tmp)
            if final.exists():  # left by an abandoned run or a crash before `latest` moved on
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(root)
            write_text_atomically(root / LATEST_FILE, final.name + "\n")
            _prune(root, step, keep_last)
        except Exception as exc:
            error = f"rank 0 could not publish {final}: {type(exc).__name__}: {exc}"
    error = _broadcast(error)
    if error:
        raise CheckpointError(error)
    return final


def _meta(
    step: int, optimizer, trainer_state: dict[str, Any], files: dict[str, tuple[int, str]]
) -> dict[str, Any]:
    from importlib.metadata import version

    try:
        readable = json.loads(json.dumps(trainer_state))
    except (TypeError, ValueError):
        readable = None  # not JSON-serialisable; the authoritative copy is trainer_state.pt
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "weight_version": trainer_state.get("weight_version"),
        "layout": current_layout(optimizer),
        "versions": {"megatron-core": version("megatron-core"), "torch": torch.__version__},
        "files": {name: size for name, (size, _) in sorted(files.items())},
        "checksums": {
            "algorithm": CHECKSUM_ALGORITHM,
            "files": {name: digest for name, (_, digest) in sorted(files.items())},
        },
        "trainer_state_keys": sorted(map(str, trainer_state)),
        "trainer_state": readable,
    }


def _remove_stale(root: Path) -> None:
    """Delete temporary directories and `latest` files of saves that never completed."""
    for path in root.iterdir():
        if path.is_dir() and _TMP_DIR.match(path.name):
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_file() and _TMP_LATEST.match(path.name):
            path.unlink(missing_ok=True)


def _prune(root: Path, step: int, keep_last: int) -> None:
    """Delete complete checkpoints older than the `keep_last` newest ones up to `step`."""
    older = [s for s in list_steps(root) if s <= step]
    for old in older[:-keep_last]:
        # Rename first so a crash mid-delete leaves a name the next save's cleanup recognises.
        doomed = root / f"{step_dir_name(old)}.old-{secrets.token_hex(6)}"
        os.rename(root / step_dir_name(old), doomed)
        shutil.rmtree(doomed)


# --------------------------------------------------------------------------- load


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
    if meta["format_version"] not in _READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: format version {meta['format_version']}, this code reads {list(_READABLE_VERSIONS)}"
        )
    if meta["format_version"] >= 2:
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
    return meta


def _check_files(directory: Path, meta: dict[str, Any], verify: list[str]) -> None:
    """Every listed file present with its recorded size; the files in `verify` also checksummed."""
    world = meta["layout"]["world_size"]
    expected = {rank_file_name(r) for r in range(world)} | {TRAINER_STATE_FILE}
    sums = meta.get("checksums", {}).get("files")
    if set(meta["files"]) != expected or (sums is not None and set(sums) != expected):
        raise CheckpointCorruptError(
            f"{directory / META_FILE} lists files {sorted(meta['files'])}, expected {sorted(expected)}"
        )
    for name, size in sorted(meta["files"].items()):
        path = directory / name
        if not path.exists():
            raise CheckpointCorruptError(f"{path} is missing (checkpoint written by {world} ranks)")
        if path.stat().st_size != size:
            raise CheckpointCorruptError(
                f"{path} has {path.stat().st_size} bytes, meta.json recorded {size}: truncated"
            )
    for name in verify if sums is not None else ():
        found = file_checksum(directory / name)
        if found != sums[name]:
            raise CheckpointCorruptError(
                f"{directory / name} is corrupt: its {CHECKSUM_ALGORITHM} is {found[:16]}..., "
                f"meta.json recorded {str(sums[name])[:16]}..."
            )


def _inspect(directory: Path, step: int, optimizer) -> tuple[str, str] | None:
    """This rank's verdict on one checkpoint: None (intact), ("damaged", why) or ("refused", why).

    Each rank checksums only what it will read: its own shard, and on rank 0 the trainer state.
    """
    rank, _ = _world()
    try:
        if not directory.is_dir():
            raise CheckpointCorruptError(f"no checkpoint for step {step}: {directory} does not exist")
        meta = read_meta(directory)
        if meta["step"] != step:
            raise CheckpointCorruptError(
                f"{directory / META_FILE} records step {meta['step']}, expected {step}"
            )
        here = current_layout(optimizer)
        saved = {key: meta["layout"].get(key) for key in here}
        if saved != here:
            raise CheckpointError(
                f"{directory} was written with layout {_layout_text(saved)}; this run has "
                f"{_layout_text(here)}. Per-rank checkpoints cannot be resharded: export the global "
                "(HF) weights and start a run with the new layout from them."
            )
        _check_files(directory, meta, [rank_file_name(rank)] + ([TRAINER_STATE_FILE] if rank == 0 else []))
    except CheckpointCorruptError as exc:
        return "damaged", str(exc)
    except CheckpointError as exc:
        return "refused", str(exc)
    return None


def _damage_everywhere(directory: Path, step: int, optimizer) -> str | None:
    """What any rank found damaged in one checkpoint (None if intact everywhere); collective.

    Raises:
        CheckpointError: a rank refuses the checkpoint for a reason an older one shares
            (another layout, an unknown format version).
    """
    verdicts = [v for v in _all_gather(_inspect(directory, step, optimizer)) if v is not None]
    refused = [why for kind, why in verdicts if kind == "refused"]
    if refused:
        raise CheckpointError(refused[0])
    return "; ".join(dict.fromkeys(why for _, why in verdicts)) or None


def _resume_candidates(root: Path, fallback: bool) -> tuple[list[int], list[str]]:
    """Steps to try, newest first, and problems already found (an unreadable `latest`).

    The step `latest` names comes first; with `fallback` the older complete ones follow.
    """
    try:
        latest = latest_step(root)
    except CheckpointCorruptError as exc:
        if not fallback:
            raise
        return sorted(list_steps(root), reverse=True), [str(exc)]
    if latest is None:
        return [], []
    older = [s for s in sorted(list_steps(root), reverse=True) if s < latest] if fallback else []
    return [latest, *older], []


def _repoint_latest(root: Path, directory: Path) -> None:
    """Make `latest` name the checkpoint resumed from (collective).

    The damaged newer checkpoints are then overwritten as the run reaches their steps again.
    """
    error = None
    if _world()[0] == 0:
        try:
            write_text_atomically(root / LATEST_FILE, directory.name + "\n")
        except OSError as exc:
            error = f"could not point {root / LATEST_FILE} at {directory.name}: {exc}"
    error = _broadcast(error)
    if error:
        raise CheckpointError(error)


def load_checkpoint(
    root: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer,
    scheduler,
    step: int | None = None,
    fallback: bool = False,
) -> dict[str, Any] | None:
    """Restore model, optimizer, scheduler and RNG states in place; return the trainer's state.

    Every rank calls it with the objects built exactly as for a fresh run of the same layout.
    Files are verified (sizes, checksums) before any state is touched.

    Args:
        root: checkpoint root directory.
        model: this rank's model shard, wrapped as when it was saved.
        optimizer: the megatron optimizer.
        scheduler: megatron's `OptimizerParamScheduler` (its settings must match the saved ones).
        step: checkpoint to load; default the one `latest` names.
        fallback: with `step` None, skip damaged checkpoints (logging a warning that names the
            step and the damaged file) for the newest older intact one, and point `latest` at it.

    Returns:
        The `trainer_state` passed to `save_checkpoint` (on every rank), or None when `step` is
        None and `root` holds no complete checkpoint yet.

    Raises:
        CheckpointCorruptError: the checkpoint is missing, incomplete or damaged (with
            `fallback`: every candidate is, each one's problem listed).
        CheckpointError: the checkpoint was written with another parallel layout (resharding is
            not supported by this format) or an unknown format version.
    """
    root = Path(root)
    problems: list[str] = []
    if step is not None:
        candidates = [step]
    else:
        candidates, problems = _resume_candidates(root, fallback)
        if not candidates and not problems:
            return None
    is_rank0 = _world()[0] == 0
    for candidate in candidates:
        directory = root / step_dir_name(candidate)
        damage = _damage_everywhere(directory, candidate, optimizer)
        if damage is None:
            if problems:
                _repoint_latest(root, directory)
                if is_rank0:
                    logger.warning(
                        "resuming from %s, the newest intact checkpoint under %s (`latest` now names it)",
                        directory.name,
                        root,
                    )
            return _restore(directory, model, optimizer, scheduler)
        if not fallback:
            raise CheckpointCorruptError(damage)
        problems.append(f"{directory.name}: {damage}")
        if is_rank0:
            logger.warning("checkpoint %s is damaged and skipped: %s", directory.name, damage)
    raise CheckpointCorruptError(f"no intact checkpoint under {root}: " + "; ".join(problems))


def _restore(directory: Path, model: torch.nn.Module, optimizer, scheduler) -> dict[str, Any]:
    rank, _ = _world()
    path = directory / rank_file_name(rank)
    # Trusted files written by this module: optimizer/RNG states hold non-tensor Python objects.
    shard = torch.load(path, map_location="cpu", weights_only=False)
    if shard.get("rank") != rank:
        raise CheckpointError(f"{path} holds the shard of rank {shard.get('rank')}, not {rank}")
    model.load_state_dict(shard["model"], strict=True)
    _load_optimizer_state(optimizer, shard["optimizer"], path)
    scheduler.load_state_dict(shard["scheduler"])
    restore_rng_state(shard["rng"])
    return torch.load(directory / TRAINER_STATE_FILE, map_location="cpu", weights_only=False)
