"""Run a module in a child process that exits when the process that started it dies.

    python -m megatron_gspo.rollout.parent_watch --parent-pid PID [--death-signal] -m MODULE [ARGS ...]

A trainer killed with SIGKILL cannot stop the rollout server it started; this wrapper makes
the server stop itself, two ways (either suffices):

- Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGTERM)`): the kernel sends SIGTERM
  the moment the parent goes. It fires when the *thread* that started the child ends, so the
  launcher asks for it (`--death-signal`) only from the main thread. A no-op elsewhere.
- A watch thread: when the launching process `PID` exits, it sends this process SIGTERM and, if
  that has not ended it after a grace period, exits hard. On Linux it waits on a pidfd of `PID`
  (woken at once, never fooled by a reused pid), so it also guards a server started through a
  wrapper command, whose parent is the wrapper (`MEGATRON_GSPO_PYTHON`); elsewhere it
  polls `os.getppid()`, which the launcher must then be.

Armed before the module is imported, so even a server still loading its model goes away.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import os
import runpy
import select
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `sig` to this process when its parent thread dies (Linux only).

    Returns:
        Whether the request was made (False where prctl is unavailable).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _open_pid(pid: int) -> int | None:
    """A pidfd of `pid` (Linux 5.3+), None where there is none; raises ProcessLookupError when gone."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, PermissionError):
        return None
    except OSError as error:
        if error.errno == errno.ENOSYS:
            return None
        raise


def _launcher_running(parent_pid: int) -> bool:
    if os.getppid() == parent_pid:
        return True
    try:
        pidfd = _open_pid(parent_pid)
    except ProcessLookupError:
        return False
    if pidfd is None:  # no pidfd: only a parent can be watched
        return False
    os.close(pidfd)
    return True


def _exit_when_orphaned(parent_pid: int, interval_s: float, grace_s: float) -> None:
    try:
        pidfd = _open_pid(parent_pid)
    except ProcessLookupError:
        pidfd = None
    else:
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the process has exited
    if pidfd is None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
    # The launcher often read this process's output: the pipe may have no reader left.
    with contextlib.suppress(OSError):
        print(f"parent process {parent_pid} is gone; exiting", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # a server's own SIGTERM handling runs first
    time.sleep(grace_s)
    os._exit(1)


def watch_parent(parent_pid: int, *, interval_s: float = 0.5, grace_s: float = 10.0) -> threading.Thread:
    """Start a daemon thread that ends this process once the process `parent_pid` has exited.

    Args:
        parent_pid: the pid the process was started by.
        interval_s: seconds between checks where there is no pidfd to wait on (the delay
            before an orphan notices).
        grace_s: seconds SIGTERM gets before the process exits hard.
    """
    thread = threading.Thread(
        target=_exit_when_orphaned, args=(parent_pid, interval_s, grace_s), name="parent-watch", daemon=True
    )
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> None:
    """Arm both guards, then run `-m MODULE` as `__main__` with the remaining arguments."""
    argv = sys.argv[1:] if argv is None else argv
    # Everything after `-m MODULE` belongs to the module, however it is spelled.
    split = argv.index("-m") + 2 if "-m" in argv else len(argv)
    own, rest = argv[:split], argv[split:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--parent-pid", type=int, required=True, help="pid of the launching process")
    parser.add_argument(
        "--death-signal", action="store_true", help="also arm Linux's parent-death signal (SIGTERM)"
    )
    parser.add_argument("--interval-s", type=float, default=0.5, help="seconds between parent checks")
    parser.add_argument("-m", dest="module", required=True, help="module to run as __main__")
    args = parser.parse_args(own)
    if args.death_signal:
        set_parent_death_signal()
    if not _launcher_running(args.parent_pid):  # it died before the guards were armed
        sys.exit(f"parent process {args.parent_pid} is gone before {args.module} started")
    if args.interval_s > 0:
        watch_parent(args.parent_pid, interval_s=args.interval_s)
    sys.argv = [args.module, *rest]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
