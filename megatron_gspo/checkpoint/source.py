"""What a tool was pointed at: an HF checkpoint, a training checkpoint or a run directory.

`serve`, `drift`, `mismatch` and `parity --hf-path` take the same three kinds of path, resolved
here and nowhere else:

- an HF checkpoint directory (`config.json` + safetensors, as `export` or transformers write);
- a training checkpoint, `RUN/checkpoints/step_NNNNNNNN` (`meta.json` + `dist/`);
- a run directory `RUN` (or its `RUN/checkpoints`): its newest intact checkpoint. Intact means
  `meta.json` reads and matches its own checksum and every file it lists is there with its
  recorded size (the small `model/` files are checksummed too); the weight files' checksums are
  verified when the export loads them. The choice is logged at INFO; damaged newer steps are
  skipped with a warning.

A training checkpoint is exported to a temporary `megatron-gspo-export-<pid>-*` directory,
removed on exit (SIGTERM included, for `serve`); one whose process died without removing it
(SIGKILL, the OOM killer) is removed by the next tool that resolves a checkpoint here.

Anything else is a one-line `ConfigError` that names the option and what the path holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_gspo.config import ConfigError
from megatron_gspo.python_command import python_command

logger = logging.getLogger(__name__)

EXPORT_PREFIX = "megatron-gspo-export-"
"""Temporary exports of training checkpoints: `<prefix><owner pid>-<random>` in the temp dir."""
CHECKPOINTS_DIR = "checkpoints"
"""Where a run directory keeps its training checkpoints (`trainer.run_dir`/checkpoints)."""
KINDS = (
    "an HF checkpoint directory (config.json + *.safetensors), a training checkpoint "
    "(RUN/checkpoints/step_NNNNNNNN) or a run directory (RUN: its newest intact checkpoint)"
)


@dataclass(frozen=True)
class CheckpointSource:
    """A resolved checkpoint path.

    Attributes:
        kind: "hf" (an HF directory) or "training" (a `save_checkpoint` directory).
        path: the HF directory or the training checkpoint's step directory.
        given: the path as the user gave it (a run directory resolves to one of its steps).
    """

    kind: Literal["hf", "training"]
    path: Path
    given: Path


def is_training_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a checkpoint directory `save_checkpoint` wrote (not an HF directory)."""
    from megatron_gspo.checkpoint.meta import DIST_DIR, META_FILE

    path = Path(path)
    return (path / META_FILE).is_file() and (path / DIST_DIR).is_dir()


def _is_hf_directory(path: Path) -> bool:
    return (path / "config.json").is_file()


def _contents(path: Path, limit: int = 8) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    shown = ", ".join(names[:limit]) + (f", ... ({len(names)} entries)" if len(names) > limit else "")
    return shown or "nothing"


def _damage(step_dir: Path) -> str | None:
    """Why `step_dir` is not an intact checkpoint, or None (see the module docstring)."""
    from megatron_gspo.checkpoint.meta import MODEL_DIR, CheckpointError, read_meta, verify_files

    try:
        meta = read_meta(step_dir)
        verify_files(step_dir, meta, sorted(n for n in meta["files"] if n.startswith(f"{MODEL_DIR}/")))
    except CheckpointError as err:
        return str(err)
    return None


def _newest_intact(root: Path, option: str, given: Path) -> Path:
    """The newest intact step directory under a checkpoint root (what `latest` names first)."""
    from megatron_gspo.checkpoint.meta import CheckpointError, step_dir_name
    from megatron_gspo.checkpoint.steps import latest_step, list_steps

    steps = sorted(list_steps(root), reverse=True)
    with contextlib.suppress(CheckpointError):  # an unreadable `latest`: the newest complete step
        latest = latest_step(root)
        if latest is not None:
            steps = [latest, *(s for s in steps if s != latest)]
    if not steps:
        raise ConfigError(f"{option} {given}: holds no checkpoint yet (no step_NNNNNNNN directory in {root})")
    problems = []
    for step in steps:
        directory = root / step_dir_name(step)
        damage = _damage(directory)
        if damage is None:
            if problems:
                logger.warning(
                    "%s %s: using %s, skipped damaged checkpoint(s): %s",
                    option,
                    given,
                    directory.name,
                    "; ".join(problems),
                )
            return directory
        problems.append(f"{directory.name}: {damage}")
    raise ConfigError(f"{option} {given}: no intact checkpoint under {root}: " + "; ".join(problems))


def resolve_checkpoint(path: str | os.PathLike, option: str) -> CheckpointSource:
    """Classify `path` (see the module docstring); `option` names the flag in errors.

    Raises:
        ConfigError: the path does not exist, is a file, is a damaged training checkpoint, a run
            directory without an intact checkpoint, or none of the three kinds.
    """
    given = Path(path)
    if not given.exists():
        raise ConfigError(f"{option} {given}: no such directory; give {KINDS}")
    if not given.is_dir():
        raise ConfigError(f"{option} {given}: is a file, not a directory; give {KINDS}")
    if is_training_checkpoint(given):
        damage = _damage(given)
        if damage is not None:
            raise ConfigError(f"{option} {given}: damaged training checkpoint: {damage}")
        return CheckpointSource("training", given, given)
    if _is_hf_directory(given):
        return CheckpointSource("hf", given, given)
    from megatron_gspo.checkpoint.steps import list_steps

    for root in (given / CHECKPOINTS_DIR, given):  # a run directory, or its checkpoint root
        if list_steps(root) or (root / "latest").is_file():
            newest = _newest_intact(root, option, given)
            logger.info("%s %s: using its newest intact checkpoint %s", option, given, newest)
            return CheckpointSource("training", newest, given)
    if (given / CHECKPOINTS_DIR).is_dir():
        raise ConfigError(
            f"{option} {given}: run directory without a checkpoint yet ({given / CHECKPOINTS_DIR})"
        )
    raise ConfigError(f"{option} {given}: not a checkpoint (it holds {_contents(given)}); give {KINDS}")


@contextlib.contextmanager
def hf_checkpoint_dir(path: str | os.PathLike, option: str) -> Iterator[Path]:
    """An HF directory for any kind of checkpoint path; a training checkpoint is exported first.

    The export runs in a child process (`megatron-gspo export`), so the caller keeps no
    distributed state; its temporary directory is removed on exit.

    Raises:
        ConfigError: the path cannot be resolved, or the export failed (its last line quoted).
    """
    remove_dead_exports()
    source = resolve_checkpoint(path, option)
    if source.kind == "hf":
        yield source.path
        return
    with tempfile.TemporaryDirectory(prefix=f"{EXPORT_PREFIX}{os.getpid()}-") as tmp:
        out = Path(tmp) / "hf"
        cmd = [*python_command(), "-m", "megatron_gspo.cli", "export", "--checkpoint", str(source.path)]
        done = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ConfigError(f"{option}: exporting training checkpoint {source.path} failed: {last}")
        yield out


def remove_dead_exports(root: str | os.PathLike | None = None) -> list[Path]:
    """Delete the temporary exports (in `root`, default the temp dir) whose owner process is gone.

    The owner is the pid in the name; names without one are left alone (not ours to judge).
    A reused pid keeps a dead export until that process ends too: never a live one removed.
    """
    removed = []
    for directory in sorted(Path(root or tempfile.gettempdir()).glob(f"{EXPORT_PREFIX}*")):
        owner = re.fullmatch(rf"{EXPORT_PREFIX}(\d+)-.*", directory.name)
        if owner is None or not directory.is_dir() or _running(int(owner.group(1))):
            continue
        shutil.rmtree(directory, ignore_errors=True)
        if not directory.exists():
            removed.append(directory)
            logger.info("removed %s, the export of a process that died (pid %s)", directory, owner.group(1))
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    return True
