"""Resuming from a training checkpoint, and `load_weights` (the model alone) for tools.

Every file is verified before any state is touched; with `fallback` a damaged checkpoint is set
aside for the newest intact one (see the package docstring).
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.checkpoint.dist import (
    RESHARDABLE_SHARDING,
    load_model_sharded,
    load_sharded,
)
from megatron_gspo.checkpoint.files import (
    write_text_atomically,
)
from megatron_gspo.checkpoint.meta import (
    DIST_DIR,
    META_FILE,
    MODEL_DIR,
    TRAINER_STATE_FILE,
    CheckpointCorruptError,
    CheckpointError,
    dist_share,
    rank_file_name,
    read_meta,
    step_dir_name,
    verify_files,
    world_rank_size,
)
from megatron_gspo.checkpoint.rng_state import restore_rng_state
from megatron_gspo.checkpoint.steps import (
    LATEST_FILE,
    CheckpointLayoutError,
    _all_gather,
    _broadcast,
    _layout_text,
    _same_layout,
    current_layout,
    is_reshardable,
    latest_step,
    list_steps,
    newest_reshardable_step,
)

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- load


def _inspect(directory: Path, step: int, optimizer) -> tuple[str, str] | None:
    """This rank's verdict on one checkpoint: None (intact), ("damaged" | "layout" | "refused", why).

    Each rank checksums its share of `dist/`, its own RNG file when it will read it (same
    layout), and on rank 0 the trainer state: together every file is verified.
    """
    rank, _ = world_rank_size()
    try:
        if not directory.is_dir():
            raise CheckpointCorruptError(f"no checkpoint for step {step}: {directory} does not exist")
        meta = read_meta(directory)
        if meta["step"] != step:
            raise CheckpointCorruptError(
                f"{directory / META_FILE} records step {meta['step']}, expected {step}"
            )
        here = current_layout(optimizer)
        if meta["layout"].get("distributed_optimizer") != here["distributed_optimizer"]:
            saved = {key: {"pipeline_parallel": 1, **meta["layout"]}.get(key) for key in here}
            raise CheckpointError(
                f"{directory} was written with layout {_layout_text(saved)}; this run has "
                f"{_layout_text(here)}. TP, EP, DP and the world size may change on resume, "
                "the optimizer kind (parallel.distributed_optimizer) may not."
            )
        if not is_reshardable(meta) and not _same_layout(meta, optimizer):
            raise CheckpointLayoutError(_routine_refusal(directory, meta, here))
        verify = dist_share(meta)
        if _same_layout(meta, optimizer):
            verify.append(rank_file_name(rank))
        if rank == 0:
            verify.append(TRAINER_STATE_FILE)
            verify += sorted(name for name in meta["files"] if name.startswith(f"{MODEL_DIR}/"))
        verify_files(directory, meta, verify)
    except CheckpointCorruptError as exc:
        return "damaged", str(exc)
    except CheckpointLayoutError as exc:
        return "layout", str(exc)
    except CheckpointError as exc:
        return "refused", str(exc)
    return None


def _routine_refusal(directory: Path, meta: dict[str, Any], here: dict[str, Any]) -> str:
    saved = {key: {"pipeline_parallel": 1, **meta["layout"]}.get(key) for key in here}
    other = newest_reshardable_step(directory.parent)
    where = (
        f"the newest under {directory.parent} is {step_dir_name(other)} "
        "(write that name into `latest` to resume from it)"
        if other is not None
        else f"there is none under {directory.parent}"
    )
    return (
        f"{directory} is a routine checkpoint (distributed optimizer state saved dp_reshardable, as "
        f"laid out at {_layout_text(saved)}); it loads only at that layout and this run has "
        f"{_layout_text(here)}. Resume at the saved layout, or from a reshardable checkpoint "
        f"(trainer.reshardable_every / trainer.reshardable_at_end): {where}"
    )


def _damage_everywhere(directory: Path, step: int, optimizer) -> str | None:
    """What any rank found damaged in one checkpoint (None if intact everywhere); collective.

    Raises:
        CheckpointError: a rank refuses the checkpoint for a reason an older one shares
            (another layout, an unknown format version).
    """
    verdicts = [v for v in _all_gather(_inspect(directory, step, optimizer)) if v is not None]
    layout = [why for kind, why in verdicts if kind == "layout"]
    if layout:
        raise CheckpointLayoutError(layout[0])
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


def _repoint_latest(root: Path, directory: Path, damaged: list[int]) -> None:
    """Make `latest` name the checkpoint resumed from, and move the damaged ones aside (collective).

    A damaged checkpoint becomes `step_N.damaged-<hex>`: kept for inspection, but no longer a
    checkpoint, so `keep_last` does not count it in place of an intact one.
    """
    error = None
    if world_rank_size()[0] == 0:
        try:
            for step in damaged:
                name = step_dir_name(step)
                if (root / name).is_dir():
                    aside = root / f"{name}.damaged-{secrets.token_hex(6)}"
                    os.rename(root / name, aside)
                    logger.warning(
                        "moved damaged checkpoint %s aside to %s (delete it when done)", name, aside
                    )
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

    Every rank calls it with the objects built as for a fresh run, at any parallel layout of
    the same model and optimizer kind. Files are verified (sizes, checksums) before any state
    is touched. RNG streams are restored only at the layout the checkpoint was written with.

    Args:
        root: checkpoint root directory.
        model: this rank's model shard (DDP-wrapped or bare).
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
        CheckpointLayoutError: a routine checkpoint (distributed optimizer, `reshardable=False`)
            was written at another parallel layout.
        CheckpointError: the checkpoint was written with the other optimizer kind (distributed or
            not), in an unknown format version, or for another model.
    """
    root = Path(root)
    problems: list[str] = []
    if step is not None:
        candidates = [step]
    else:
        candidates, problems = _resume_candidates(root, fallback)
        if not candidates and not problems:
            return None
    is_rank0 = world_rank_size()[0] == 0
    damaged: list[int] = []
    for candidate in candidates:
        directory = root / step_dir_name(candidate)
        damage = _damage_everywhere(directory, candidate, optimizer)
        if damage is None:
            if problems:
                _repoint_latest(root, directory, damaged)
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
        damaged.append(candidate)
        if is_rank0:
            logger.warning("checkpoint %s is damaged and skipped: %s", directory.name, damage)
    raise CheckpointCorruptError(f"no intact checkpoint under {root}: " + "; ".join(problems))


def load_weights(checkpoint_dir: str | os.PathLike, model: torch.nn.Module) -> dict[str, Any]:
    """Verify a checkpoint's weight files and load only the model, at any layout (collective).

    Returns:
        The checkpoint's meta.json.

    Raises:
        CheckpointCorruptError: a file is missing or damaged (named).
        CheckpointError: the checkpoint does not fit the model.
    """
    directory = Path(checkpoint_dir)

    def inspect() -> str | None:
        try:
            meta = read_meta(directory)
            own = [name for name in meta["files"] if name.startswith(f"{MODEL_DIR}/")]
            verify_files(directory, meta, dist_share(meta) + (own if world_rank_size()[0] == 0 else []))
        except CheckpointError as exc:
            return str(exc)
        return None

    damage = [why for why in _all_gather(inspect()) if why]
    if damage:
        raise CheckpointCorruptError(damage[0])
    try:
        load_model_sharded(directory / DIST_DIR, model)
    except Exception as exc:  # megatron names the tensor that does not fit
        raise CheckpointError(
            f"{directory / DIST_DIR} does not fit this model: {type(exc).__name__}: {exc}"
        ) from exc
    return read_meta(directory)


def _restore(directory: Path, model: torch.nn.Module, optimizer, scheduler) -> dict[str, Any]:
    rank, _ = world_rank_size()
    meta = read_meta(directory)
    try:
        load_sharded(
            directory / DIST_DIR,
            model,
            optimizer,
            meta["optimizer_step"],
            with_optimizer=meta.get("optimizer_state", True),  # absent from older checkpoints
            sharding=meta.get("optimizer_sharding", RESHARDABLE_SHARDING),
        )
    except Exception as exc:  # megatron names the tensor that does not fit
        raise CheckpointError(
            f"{directory / DIST_DIR} does not fit this model: {type(exc).__name__}: {exc}"
        ) from exc
    scheduler.load_state_dict(meta["scheduler"])
    if _same_layout(meta, optimizer):
        path = directory / rank_file_name(rank)
        # Trusted files written by this module: RNG states hold non-tensor Python objects.
        shard = torch.load(path, map_location="cpu", weights_only=False)
        if shard.get("rank") != rank:
            raise CheckpointError(f"{path} holds the RNG streams of rank {shard.get('rank')}, not {rank}")
        restore_rng_state(shard["rng"])
    elif rank == 0:
        logger.warning(
            "%s was written with layout %s, this run has %s: weights and optimizer state are "
            "resharded; random streams are not restored (this run keeps its own seeding)",
            directory.name,
            _layout_text(meta["layout"]),
            _layout_text(current_layout(optimizer)),
        )
    return torch.load(directory / TRAINER_STATE_FILE, map_location="cpu", weights_only=False)
