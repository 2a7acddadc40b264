"""Training checkpoints: resume a run exactly, atomically, at the same or another parallel layout.

Layout of a checkpoint root::

    root/
      latest                  name of the newest complete checkpoint directory (one line)
      step_00000003/
        meta.json             step, weight_version, parallel layout, scheduler state, Adam step,
                              whether optimizer state was saved (not before the first step),
                              versions, every file's size and SHA-256, and meta.json's own checksum
        trainer_state.pt      the trainer's own state (data position, running stats, counters, config)
        rank_00000.pt         this rank's RNG streams
        rank_00001.pt
        dist/                 model and optimizer: megatron `dist_checkpointing` (torch_dist),
                              written fully parallel (see `checkpoint_dist`)
        model/                config.json (HF form) and the run's tokenizer, for `megatron-gspo export`

Resharding: model weights and optimizer state (Adam moments, fp32 main params, step) are
stored per global tensor, so a checkpoint written at TP2 resumes at EP2, at TP1 x EP1, or at
any other layout of the same model; only the optimizer kind (distributed or not) must match.
The exception is the distributed optimizer's routine save (`reshardable=False`): its state is
each rank's slice of megatron's flat buffers (`dp_reshardable`), written without the gather
into host memory that a reshardable save costs, and it loads only at the layout that wrote it;
another layout is refused (`CheckpointLayoutError`) in favour of a reshardable checkpoint,
the newest of which `keep_last` never deletes.
RNG streams are per rank and only restored at the same layout (world size, TP, EP, ETP, DP);
at another layout the run keeps the streams it was seeded with, and says so.

Atomicity: all ranks write into a fresh `step_N.tmp-<random>/` directory and fsync their
files; once every rank has succeeded, rank 0 renames the directory to `step_N/` and then
replaces `latest` through a temporary file and `os.replace`. A crash at any point leaves
`latest` naming either the previous complete checkpoint or the new one; directories a crash
left behind are removed by the next save.

Integrity: the checksums of our own files are computed while they are written; megatron's
files under `dist/` are read back after the save (from the page cache), each rank hashing
and fsyncing a share of them. Loading verifies every file before any state is touched: each
rank its own RNG file (rank 0 also the trainer state) and a share of `dist/`, so every file
is checked by one rank. A damaged file is named. With `fallback=True` (what `--resume` uses)
a damaged checkpoint is skipped with a warning for the newest older intact one, `latest`
is pointed at it and the damaged one is moved aside (`step_N.damaged-<hex>`, never deleted,
never counted by `keep_last`); only when none is intact does loading fail, listing what was
wrong with each.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.model.config import MoEModelConfig
from megatron_gspo.model.control_plane import all_gather_objects, broadcast_from_rank0
from megatron_gspo.training.checkpoint_dist import (
    RESHARDABLE_SHARDING,
    ROUTINE_SHARDING,
    is_distributed_optimizer,
    leaf_optimizers,
    load_model_sharded,
    load_sharded,
    optimizer_has_state,
    optimizer_step_count,
    save_sharded,
)
from megatron_gspo.training.checkpoint_files import (
    CHECKSUM_ALGORITHM,
    durable_checksum,
    fsync_dir,
    save_durably,
    write_meta,
    write_text_atomically,
)
from megatron_gspo.training.checkpoint_meta import (
    DIST_DIR,
    FORMAT_VERSION,
    META_FILE,
    MODEL_DIR,
    TRAINER_STATE_FILE,
    CheckpointCorruptError,
    CheckpointError,
    dist_share,
    my_share,
    rank_file_name,
    read_meta,
    step_dir_name,
    verify_files,
    world_rank_size,
)
from megatron_gspo.training.rng_state import capture_rng_state, restore_rng_state

__all__ = [  # names other modules and the tests take from here
    "DIST_DIR",
    "META_FILE",
    "MODEL_DIR",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointLayoutError",
    "current_layout",
    "is_reshardable",
    "latest_step",
    "list_steps",
    "load_checkpoint",
    "load_weights",
    "newest_reshardable_step",
    "read_meta",
    "resumable_step",
    "save_checkpoint",
]

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
    model_cfg: MoEModelConfig | None = None,
    tokenizer=None,
    reshardable: bool = True,
) -> Path:
    """Write the checkpoint of `step` atomically and make it `latest` (collective: every rank calls it).

    Args:
        root: checkpoint root directory (created if needed; shared by all ranks).
        step: the optimizer step just completed.
        model: this rank's model shard (DDP-wrapped or bare; megatron's `sharded_state_dict()`).
        optimizer: the megatron optimizer (`get_megatron_optimizer`), distributed or not.
        scheduler: megatron's `OptimizerParamScheduler`.
        trainer_state: the trainer's own state (data position, running statistics, counters,
            config dump, `weight_version`), torch-serialisable; stored once, by rank 0.
        keep_last: complete checkpoints to keep (the newest ones up to `step`); older ones are
            deleted after the new one is in place.
        model_cfg: the architecture, written (by rank 0) as `model/config.json` so that
            `megatron-gspo export` can rebuild the model from the checkpoint alone.
        tokenizer: the run's tokenizer, saved under `model/` beside it (HF `save_pretrained`).
        reshardable: whether the checkpoint must load at any layout. False (a routine save)
            writes the distributed optimizer's state as each rank holds it (`dp_reshardable`),
            loadable only at this layout; True gathers it into model space on every DP rank's
            host (`fully_reshardable`). Other optimizers are reshardable either way.

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
    rank, world = world_rank_size()
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
            (root / tmp_name / DIST_DIR).mkdir()
        except Exception as exc:  # reported on every rank below
            error = f"rank 0 could not prepare {root}: {exc}"
    error, tmp_name = _broadcast((error, tmp_name))
    if error:
        raise CheckpointError(error)
    tmp = root / tmp_name

    files: dict[str, tuple[int, str]] = {}  # name -> (bytes, checksum)
    failure = None
    with_optimizer = any(_all_gather(optimizer_has_state(optimizer)))
    sharding = RESHARDABLE_SHARDING if reshardable else ROUTINE_SHARDING
    try:
        save_sharded(tmp / DIST_DIR, model, optimizer, with_optimizer=with_optimizer, sharding=sharding)
        files |= _checksum_share(tmp, _broadcast(_dist_files(tmp) if rank == 0 else None))
        files[rank_file_name(rank)] = save_durably(
            {"format_version": FORMAT_VERSION, "rank": rank, "rng": capture_rng_state()},
            tmp / rank_file_name(rank),
        )
        if rank == 0:
            files[TRAINER_STATE_FILE] = save_durably(trainer_state, tmp / TRAINER_STATE_FILE)
            files |= _save_model_description(tmp, model_cfg, tokenizer)
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
            meta = _meta(step, optimizer, scheduler, trainer_state, all_files, with_optimizer, sharding)
            write_meta(tmp / META_FILE, meta)
            fsync_dir(tmp / DIST_DIR)
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


def _save_model_description(directory: Path, model_cfg, tokenizer) -> dict[str, tuple[int, str]]:
    """`model/config.json` (HF form) and the tokenizer files; their sizes and checksums."""
    if model_cfg is None:
        return {}
    target = directory / MODEL_DIR
    target.mkdir()
    (target / "config.json").write_text(json.dumps(model_cfg.to_hf_config(), indent=2, sort_keys=True))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(target))
    fsync_dir(target)
    return {f"{MODEL_DIR}/{p.name}": durable_checksum(p) for p in sorted(target.iterdir())}


def _dist_files(directory: Path) -> list[str]:
    """Names (relative to `directory`) of the files megatron wrote under `dist/`, sorted."""
    return sorted(f"{DIST_DIR}/{p.name}" for p in (directory / DIST_DIR).iterdir() if p.is_file())


def _checksum_share(directory: Path, names: list[str]) -> dict[str, tuple[int, str]]:
    """Size and checksum of this rank's share of `names`, each file fsynced on the way."""
    return {name: durable_checksum(directory / name) for name in my_share(names)}


def _meta(
    step: int,
    optimizer,
    scheduler,
    trainer_state: dict[str, Any],
    files: dict[str, tuple[int, str]],
    with_optimizer: bool,
    sharding: str,
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
        "optimizer_step": optimizer_step_count(optimizer),
        "optimizer_state": with_optimizer,  # False: saved before the first step, model only
        "optimizer_sharding": sharding,  # the distributed optimizer's format (others: model space)
        "scheduler": scheduler.state_dict(),
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
    """Delete complete checkpoints older than the `keep_last` newest intact ones up to `step`.

    Only checkpoints whose meta.json reads back intact are counted (or deleted): a damaged one
    must not stand in for an intact older one. Those a resume found damaged were moved aside.
    The newest reshardable one is kept too: the only way to resume at another layout.
    """
    older = [s for s in list_steps(root) if s <= step and _meta_intact(root / step_dir_name(s))]
    keep = newest_reshardable_step(root, older)
    for old in older[:-keep_last]:
        if old == keep:
            continue
        # Rename first so a crash mid-delete leaves a name the next save's cleanup recognises.
        doomed = root / f"{step_dir_name(old)}.old-{secrets.token_hex(6)}"
        os.rename(root / step_dir_name(old), doomed)
        shutil.rmtree(doomed)


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
