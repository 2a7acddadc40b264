"""One run at a time per directory: an exclusive lock on every directory a run writes.

Two trainers sharing a run directory (or a `trainer.weight_sync_dir`) would read each other's
exported weights, interleave steps in one metrics.jsonl and leave a config.yaml that does not
match the checkpoints. Rank 0 therefore holds an `flock` on a lock file for each such directory
for the whole run; the kernel drops it when the process dies, however it dies, so a crashed run
never blocks the next one. The lock file records the holder's pid and host for the message.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

from megatron_gspo.config import ConfigError

LOCK_NAME = ".megatron-gspo.lock"


class RunDirInUseError(ConfigError):
    """Another live run holds the lock of a directory this run would write."""


def lock_path(directory: Path, *, inside: bool) -> Path:
    """The lock file of `directory`: inside it, or beside it for a directory replaced whole."""
    return directory / LOCK_NAME if inside else directory.parent / f".{directory.name}.lock"


class RunLock:
    """Exclusive locks on a run's directories, held until `release` (or the process ends)."""

    def __init__(self) -> None:
        self._fds: list[int] = []

    def acquire(self, path: Path, key: str, directory: Path) -> None:
        """Lock `path` (created if needed) for this process.

        Args:
            path: the lock file.
            key: the config key naming the directory, for the error message.
            directory: its value.

        Raises:
            RunDirInUseError: another process holds it (named with its pid and host).
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirInUseError(
                f"{key}={directory} is in use by another run ({holder}, lock {path}): stop that run "
                f"or choose another {key}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        self._fds.append(fd)

    def release(self) -> None:
        """Drop every lock this object holds."""
        for fd in self._fds:
            os.close(fd)  # closing the descriptor releases its flock
        self._fds = []


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        holder = {}
    if not isinstance(holder, dict) or "pid" not in holder:
        return "pid unknown"
    return f"pid {holder['pid']} on {holder.get('host', '?')}"
