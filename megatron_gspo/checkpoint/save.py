"""Saving a training checkpoint, atomically and checksummed.

Every rank writes, checksums and fsyncs its files into a fresh directory that rank 0 renames
into place (see the package docstring: atomicity, integrity).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_gspo.checkpoint.dist import (
    RESHARDABLE_SHARDING,
    ROUTINE_SHARDING,
    optimizer_has_state,
    optimizer_step_count,
    save_sharded,
)
from megatron_gspo.checkpoint.files import (
    durable_checksum,
    fsync_dir,
    save_durably,
    write_meta,
    write_text_atomically,
)
from megatron_gspo.checkpoint.meta import (
    DIST_DIR,
    FORMAT_VERSION,
    META_FILE,
    MODEL_DIR,
    TRAINER_STATE_FILE,
    CheckpointError,
    CheckpointSpaceError,
    my_share,
    rank_file_name,
    step_dir_name,
    world_rank_size,
)
from megatron_gspo.checkpoint.rng_state import capture_rng_state
from megatron_gspo.checkpoint.steps import (
    _TMP_DIR,
    _TMP_LATEST,
    LATEST_FILE,
    _all_gather,
    _broadcast,
    _meta_intact,
    _read_latest_name,
    current_layout,
    list_steps,
    newest_reshardable_step,
)
from megatron_gspo.checksums import CHECKSUM_ALGORITHM
from megatron_gspo.model.config import MoEModelConfig
from megatron_gspo.model.hf.config import to_hf_config

logger = logging.getLogger(__name__)


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
        CheckpointSpaceError: the disk filled up (the new directory is removed, the older kept).
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
    megatron_errors = _ErrorRecords()
    try:
        with megatron_errors.attached("megatron.core.dist_checkpointing"):
            save_sharded(tmp / DIST_DIR, model, optimizer, with_optimizer=with_optimizer, sharding=sharding)
        files |= _checksum_share(tmp, _broadcast(_dist_files(tmp) if rank == 0 else None))
        files[rank_file_name(rank)] = save_durably(
            {"format_version": FORMAT_VERSION, "rank": rank, "rng": capture_rng_state()},
            tmp / rank_file_name(rank),
        )
        if rank == 0:
            files[TRAINER_STATE_FILE] = save_durably(trainer_state, tmp / TRAINER_STATE_FILE)
            files |= _save_model_description(tmp, model_cfg, tokenizer)
    except (Exception, CheckpointException) as exc:  # megatron's is a BaseException
        failure = (f"rank {rank}: {_describe(exc)}", _out_of_space(exc, megatron_errors.messages))
    failures = [f for f in _all_gather(failure) if f]
    all_files = {k: v for f in _all_gather(files) for k, v in f.items()}
    if failures:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if any(full for _, full in failures):
            raise CheckpointSpaceError(_space_message(root, step))
        raise CheckpointError(f"saving step {step} to {root} failed: " + "; ".join(f for f, _ in failures))

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
            shutil.rmtree(tmp, ignore_errors=True)  # gone already if the rename happened
            error = (f"rank 0 could not publish {final}: {_describe(exc)}", _out_of_space(exc))
    error = _broadcast(error)
    if error:
        raise CheckpointSpaceError(_space_message(root, step)) if error[1] else CheckpointError(error[0])
    return final


def _causes(exc: BaseException):
    """`exc`, what it was raised from, and the failures a megatron `CheckpointException` wraps."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [wrapped for wrapped, _ in e.failures.values()]


class _ErrorRecords(logging.Handler):
    """The ERROR records a logger tree emits while attached (their messages)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    @contextlib.contextmanager
    def attached(self, name: str):
        logging.getLogger(name).addHandler(self)
        try:
            yield self
        finally:
            logging.getLogger(name).removeHandler(self)


def _out_of_space(exc: BaseException, logged: list[str] = ()) -> bool:
    """Whether the disk (or the user's quota) filled up somewhere behind `exc`.

    Megatron's writers pass a worker's error on as text (0.16: the cause is lost between
    processes) or only log it (0.19 raises "error: <class 'OSError'>"), so its ERROR records
    during the save (`logged`) are read too.
    """
    codes = (errno.ENOSPC, errno.EDQUOT)
    texts = [str(e) for e in _causes(exc)] + list(logged)
    return any(isinstance(e, OSError) and e.errno in codes for e in _causes(exc)) or any(
        os.strerror(c) in text for c in codes for text in texts
    )


def _describe(exc: BaseException) -> str:
    """One line for a failed write: the innermost error (megatron's own message is a traceback)."""
    roots = [e for e in _causes(exc) if not isinstance(e, CheckpointException) and not e.__cause__]
    first = roots[0] if roots else exc
    return f"{type(first).__name__}: {(str(first).splitlines() or [''])[0]}"


def _space_message(root: Path, step: int) -> str:
    """What a full disk cost: where, about how much a save needs, what is kept and how to go on."""
    kept = [s for s in list_steps(root) if _meta_intact(root / step_dir_name(s))]
    need = ""
    if kept:
        meta = json.loads((root / step_dir_name(kept[-1]) / META_FILE).read_text())
        size = sum(meta.get("files", {}).values())
        need = f"; a checkpoint needs about {size / 2**20:.1f} MiB (step {kept[-1]}'s size)"
    free = shutil.disk_usage(root).free / 2**20
    if kept:
        latest = _read_latest_name(root)
        intact = ", ".join(step_dir_name(s) for s in kept)
        what = f"the previous checkpoints are intact ({intact}; latest: {latest}): free space, then --resume"
    else:
        what = "no earlier checkpoint was saved"
    return (
        f"no space left on device saving checkpoint step {step} under {root} "
        f"({free:.1f} MiB free{need}); nothing of step {step} was kept; {what}"
    )


def _save_model_description(directory: Path, model_cfg, tokenizer) -> dict[str, tuple[int, str]]:
    """`model/config.json` (HF form) and the tokenizer files; their sizes and checksums."""
    if model_cfg is None:
        return {}
    target = directory / MODEL_DIR
    target.mkdir()
    (target / "config.json").write_text(json.dumps(to_hf_config(model_cfg), indent=2, sort_keys=True))
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
