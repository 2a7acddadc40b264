"""RAM-backed weight exports of dead runs are removed by the next start (a temporary root
stands in for /dev/shm)."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from megatron_gspo.config import ConfigError
from megatron_gspo.weight_sync.shm_exports import (
    OWNER_FILE,
    ExportDirInUseError,
    claim_export_dir,
    process_start_time,
    remove_dead_exports,
)

HOST = socket.gethostname()
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


def _dead_pid():
    """A pid that was just in use and whose process has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _export(root, tag, owner=None):
    directory = root / f"megatron-gspo-{tag}"
    (directory / "policy").mkdir(parents=True)
    (directory / "policy" / "model.safetensors").write_bytes(b"\0" * 64)
    if owner is not None:
        (directory / OWNER_FILE).write_text(owner if isinstance(owner, str) else json.dumps(owner))
    return directory


@linux_only
def test_only_exports_of_dead_owners_are_removed(tmp_path):
    me = {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "host": HOST}
    dead = _export(tmp_path, "dead", {"pid": _dead_pid(), "start_time": 1, "host": HOST})
    reused = _export(tmp_path, "reused", {**me, "start_time": me["start_time"] - 1})  # pid reused since
    live = _export(tmp_path, "live", me)
    legacy = _export(tmp_path, "legacy")  # no owner record: not ours to judge
    garbled = _export(tmp_path, "garbled", "{not json")
    remote = _export(tmp_path, "remote", {**me, "pid": _dead_pid(), "host": HOST + "-elsewhere"})
    other = tmp_path / "other-tool"
    other.mkdir()
    (other / OWNER_FILE).write_text(json.dumps({"pid": _dead_pid(), "host": HOST}))

    assert remove_dead_exports(tmp_path) == [dead, reused]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (live, legacy, garbled, remote, other)
    )
    assert remove_dead_exports(tmp_path) == []


@linux_only
def test_claim_cleans_up_records_the_owner_and_refuses_a_live_one(tmp_path):
    dead = _export(tmp_path, "dead", {"pid": _dead_pid(), "start_time": 1, "host": HOST})
    mine = tmp_path / "megatron-gspo-mine"
    claim_export_dir(mine)
    assert not dead.exists()
    owner = json.loads((mine / OWNER_FILE).read_text())
    assert owner == {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "host": HOST}
    claim_export_dir(mine)  # claiming again from the same process is fine

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / "megatron-gspo-busy"
        busy.mkdir()
        started = process_start_time(sleeper.pid)
        (busy / OWNER_FILE).write_text(json.dumps({"pid": sleeper.pid, "start_time": started, "host": HOST}))
        with pytest.raises(ExportDirInUseError, match=rf"belongs to a running process \(pid {sleeper.pid}"):
            claim_export_dir(busy)
        assert issubclass(ExportDirInUseError, ConfigError)  # a user error: exit 2, one line
    finally:
        os.kill(sleeper.pid, signal.SIGKILL)
        sleeper.wait()
    claim_export_dir(busy)  # its owner died: this run takes it over
    assert json.loads((busy / OWNER_FILE).read_text())["pid"] == os.getpid()


@linux_only
def test_process_start_time_orders_processes():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_start_time(child.pid) >= process_start_time(os.getpid()) > 0
    finally:
        child.kill()
        child.wait()
    assert process_start_time(child.pid) is None
