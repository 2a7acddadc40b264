"""No orphans: a process started under `parent_watch` exits when its parent is SIGKILLed.

Each case runs a small parent process that starts the child, waits until the child is up,
writes the child's pid to a file and sleeps; the test SIGKILLs the parent and waits (bounded)
for the child to be gone. A child started without the guard is the control: it survives.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.python_command import PYTHON_VAR
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, signals")

# The servers start as deployments start them: a fresh interpreter, the launcher's child.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
ENV.pop(PYTHON_VAR, None)

GUARDED_SLEEPER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    pid_file, log, *guard = sys.argv[1:]
    cmd = [sys.executable]
    if guard != ["none"]:
        cmd += ["-m", "megatron_gspo.rollout.parent_watch", "--parent-pid", str(os.getpid()), *guard]
    cmd += ["-m", "http.server", "--bind", "127.0.0.1", "0"]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    child.stdout.readline()  # "Serving HTTP on ...": the guards are armed
    open(pid_file, "w").write(str(child.pid))
    time.sleep(600)
    """
)

TRAINER_LIKE = textwrap.dedent(
    """
    import sys, threading, time
    from megatron_gspo.rollout.server.launch import launch_embedded_server
    def launch():  # as rollout_servers() starts it for the trainer
        server = launch_embedded_server(sys.argv[2])
        open(sys.argv[1], "w").write(str(server.process.pid))
    if sys.argv[3] == "main":
        launch()
    else:  # no parent-death signal: the watch alone, whose message goes to a pipe nobody reads
        threading.Thread(target=launch).start()
    time.sleep(600)
    """
)


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaps has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _start_parent(script: str, pid_file: Path, *args: str, timeout: float = 120.0):
    parent = subprocess.Popen([sys.executable, "-c", script, str(pid_file), *args], env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + timeout
    while not pid_file.exists() or not pid_file.read_text():
        if parent.poll() is not None:
            raise AssertionError(f"parent exited with {parent.returncode}: {parent.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, "the child never came up"
        time.sleep(0.05)
    return parent, int(pid_file.read_text())


def _kill_and_wait_for(parent, child_pid: int, timeout: float = 30.0) -> bool:
    """SIGKILL the parent; True once the child is gone, False if it still runs after `timeout` s."""
    assert _running(child_pid)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    parent.stderr.close()
    deadline = time.monotonic() + timeout
    while _running(child_pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize(
    "guard, by_watch",
    [
        (["--death-signal", "--interval-s", "0"], False),  # the kernel's parent-death signal alone
        (["--interval-s", "0.2"], True),  # the watch thread alone (a pidfd here; polls where none)
        (["--death-signal"], False),  # both, as launch_embedded_server arms them
    ],
    ids=["death-signal", "watch", "both"],
)
def test_guarded_child_exits_when_its_parent_is_killed(tmp_path, guard, by_watch):
    log = tmp_path / "child.log"
    parent, child = _start_parent(GUARDED_SLEEPER, tmp_path / "pid", str(log), *guard)
    assert _kill_and_wait_for(parent, child)
    # The watch reports what it saw; with the signal alone the kernel ended the child silently.
    assert ("is gone; exiting" in log.read_text()) == by_watch


def test_unguarded_child_is_orphaned(tmp_path):
    parent, child = _start_parent(GUARDED_SLEEPER, tmp_path / "pid", str(tmp_path / "log"), "none")
    try:
        assert not _kill_and_wait_for(parent, child, timeout=3.0)  # what the guard prevents
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("thread", ["main", "other"])
def test_embedded_server_exits_when_the_process_that_launched_it_is_killed(tmp_path, thread):
    config = tiny(vocab_size=len(build_char_tokenizer()))
    checkpoint = make_tiny_hf_checkpoint(tmp_path / "hf", config, seed=0)
    parent, server = _start_parent(TRAINER_LIKE, tmp_path / "pid", str(checkpoint), thread)
    assert _kill_and_wait_for(parent, server), f"embedded server {server} outlived its trainer"


def test_parent_gone_before_the_guard_was_armed(tmp_path):
    gone = subprocess.Popen(["true"])  # a launcher that has exited (its pid is not reused this soon)
    gone.wait()
    guard = [sys.executable, "-m", "megatron_gspo.rollout.parent_watch", "--parent-pid", str(gone.pid)]
    done = subprocess.run(
        [*guard, "-m", "http.server"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert f"parent process {gone.pid} is gone before http.server started" in done.stderr
