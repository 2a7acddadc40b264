"""RAM-backed weight exports (`/dev/shm/megatron-gspo-<tag>/`) that outlive no run.

A trainer removes its export directory when it closes, but a trainer killed by SIGKILL (or
the OOM killer) cannot, and `/dev/shm` is memory: a 30B-parameter policy left there holds
60 GB until reboot. So each export directory records its owner (`owner.json`: pid, the
process's start time, host), and every trainer start removes the directories whose owner is
dead before claiming its own. The start time tells a live owner from a dead one whose pid was
reused; directories without an owner record are left alone (they may be another tool's, or
being created right now).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from pathlib import Path

from megatron_gspo.config import ConfigError

logger = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")
PREFIX = "megatron-gspo-"
OWNER_FILE = "owner.json"


class ExportDirInUseError(ConfigError):
    """Another live process owns the export directory this run would write to (same run dir)."""


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (Linux `/proc`), or None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22; the command name (field 2) may contain spaces, so count from its closing ")".
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive(owner: dict) -> bool:
    """Whether the process an owner record names still runs (unknown counts as alive)."""
    if owner.get("host") != socket.gethostname():
        return True  # another machine sharing this directory: cannot tell
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    started = process_start_time(pid)
    return started is None or owner.get("start_time") in (None, started)


def _read_owner(directory: Path) -> dict | None:
    try:
        owner = json.loads((directory / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def remove_dead_exports(root: Path = SHM_ROOT) -> list[Path]:
    """Delete `root/megatron-gspo-*` directories whose recorded owner process is dead.

    Returns:
        The directories removed.
    """
    removed = []
    for directory in sorted(root.glob(f"{PREFIX}*")):
        owner = _read_owner(directory) if directory.is_dir() else None
        if owner is None or _alive(owner):
            continue
        shutil.rmtree(directory, ignore_errors=True)
        if not directory.exists():
            removed.append(directory)
            logger.warning(
                "removed %s, weights exported by a run that died (pid %s)", directory, owner.get("pid")
            )
    return removed


def claim_export_dir(directory: Path) -> None:
    """Clean up dead runs' exports next to `directory`, then record this process as its owner.

    Args:
        directory: this run's `root/megatron-gspo-<tag>` (its exports go below it).

    Raises:
        ExportDirInUseError: a live process already owns `directory` (two runs on one run dir).
    """
    remove_dead_exports(directory.parent)
    owner = _read_owner(directory)
    if owner is not None and owner.get("pid") != os.getpid() and _alive(owner):
        raise ExportDirInUseError(
            f"{directory} belongs to a running process (pid {owner.get('pid')} on {owner.get('host')}): "
            "another run uses the same trainer.run_dir; stop it or choose another run dir"
        )
    directory.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "host": socket.gethostname()}
    tmp = directory / f".{OWNER_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, directory / OWNER_FILE)
