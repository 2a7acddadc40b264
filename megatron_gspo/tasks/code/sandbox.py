"""Run one untrusted Python program in a sandbox: namespaces from bubblewrap, limits from setrlimit.

Every run is a fresh `bwrap` process (Debian package `bubblewrap`) that gives the program:

- its own user, PID, network, IPC and UTS namespaces: no network but an unconnected loopback,
  no view of (or signal to) any process outside, no capabilities;
- a new root holding only the system's read-only directories (/usr, /bin, /lib*, the Python
  installation) and the program's read-only code directory; nothing else of the host's files
  exists there (no /home, /root, /work, host /tmp);
- a fresh, size-capped tmpfs at /tmp as its working directory, gone when it ends;
- resource limits set *inside* the user namespace by `prlimit` (util-linux) before the
  interpreter starts: CPU seconds, address space, file size, process count (counted per
  sandbox, since the namespace is new), open files, no core dumps.

The caller waits out a wall-clock limit and then kills the sandbox's whole process group;
bwrap's `--die-with-parent` and the PID namespace take every descendant with it. Output goes to
files, never pipes, so a program that closes its stdout, or floods it, cannot stall the caller
(the file-size limit caps what it writes).

What this does not protect against: kernel exploits (there is no seccomp filter), CPU and memory
bandwidth taken from neighbours while it runs, and a program reading what the system directories
hold (they are the host's, read-only).

`sandbox: none` (`UnsandboxedRunner`) keeps the limits and the process-group kill but none of
the namespaces: for machines without bubblewrap, at the user's explicit, logged risk.
"""

from __future__ import annotations

import functools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

CODE_DIR = "/code"
"""Where the program's files appear (read-only) inside the sandbox."""
WORK_DIR = "/tmp"
"""The program's working directory inside the sandbox: a fresh size-capped tmpfs."""
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap; Fedora: dnf install bubblewrap)"
)


class SandboxUnavailableError(RuntimeError):
    """No working sandbox on this machine (bubblewrap missing or unable to create namespaces)."""


class RunStatus(StrEnum):
    """How a sandboxed run ended."""

    OK = "ok"  # exit status 0
    ERROR = "error"  # non-zero exit or a signal other than the time limits' (crash, MemoryError, ...)
    TIMEOUT = "timeout"  # the CPU limit (SIGXCPU) or the wall-clock limit


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run.

    Attributes:
        cpu_s: CPU seconds (RLIMIT_CPU; SIGXCPU at the limit, SIGKILL one second later).
        wall_s: wall-clock seconds before the caller kills the process group.
        memory_mb: address space (RLIMIT_AS) in MiB.
        file_size_mb: largest file the program may write (RLIMIT_FSIZE), its output included.
        disk_mb: size of the tmpfs working directory.
        processes: processes and threads inside the sandbox (RLIMIT_NPROC, per sandbox).
        open_files: file descriptors (RLIMIT_NOFILE).
    """

    cpu_s: int = 2
    wall_s: float = 6.0
    memory_mb: int = 512
    file_size_mb: int = 16
    disk_mb: int = 32
    processes: int = 16
    open_files: int = 64

    def __post_init__(self):
        for name in ("cpu_s", "memory_mb", "file_size_mb", "disk_mb", "processes", "open_files"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"sandbox limit {name} must be >= 1, got {getattr(self, name)}")
        if self.wall_s <= 0:
            raise ValueError(f"sandbox limit wall_s must be > 0, got {self.wall_s}")

    def prlimit_args(self) -> list[str]:
        """`prlimit` options setting these limits (soft:hard)."""
        mib = 1 << 20
        return [
            f"--cpu={self.cpu_s}:{self.cpu_s + 1}",
            f"--as={self.memory_mb * mib}",
            f"--fsize={self.file_size_mb * mib}",
            f"--nproc={self.processes}",
            f"--nofile={self.open_files}",
            "--core=0",
        ]


@dataclass(frozen=True)
class RunResult:
    """The outcome of one sandboxed run.

    Attributes:
        status: how it ended.
        returncode: the exit status (negative: killed by that signal).
        stdout: what it wrote to standard output (at most `Limits.file_size_mb`).
        stderr: the tail of its standard error (decoded, for logs).
        wall_s: seconds from start to reaped.
    """

    status: RunStatus
    returncode: int
    stdout: bytes
    stderr: str
    wall_s: float


SANDBOX_ENV = (("PATH", "/usr/bin:/bin"), ("LANG", "C.UTF-8"))
"""The whole environment bwrap (and so the sandbox's pid 1) starts with: nothing of the trainer's."""
_NOBODY = 65534  # the kernel's overflow uid; owns nothing on the host
_TIME_SIGNALS = (signal.SIGXCPU, signal.SIGKILL)  # SIGKILL: the hard CPU limit


def _status(returncode: int, timed_out: bool) -> RunStatus:
    if timed_out:
        return RunStatus.TIMEOUT
    if returncode == 0:
        return RunStatus.OK
    signum = -returncode if returncode < 0 else returncode - 128  # bwrap reports 128 + signal
    return RunStatus.TIMEOUT if signum in _TIME_SIGNALS else RunStatus.ERROR


class _Runner:
    """Writes the program's files, starts the command, waits out the wall limit, kills, reads."""

    python: str
    version: tuple[int, int] | None = None  # (major, minor) of `python`, when known
    host_dir: str | None = None  # where each run's files are kept on the host (None: the temp dir)

    def command(self, code_dir: str, argv: list[str], limits: Limits, info_fd: int) -> list[str]:
        raise NotImplementedError

    def popen_user(self) -> dict:
        """Extra `Popen` arguments that choose the user the command starts as (none: the caller's)."""
        return {}

    def run(self, files: dict[str, str], argv: list[str], stdin: bytes, limits: Limits) -> RunResult:
        """Run `argv` (paths under `CODE_DIR`) with `files` in the code directory and `stdin` as input.

        Args:
            files: file name -> text, written to the read-only code directory.
            argv: the command inside the sandbox, e.g. [python, "/code/main.py"].
            stdin: the program's whole standard input.
            limits: resource limits.

        Returns:
            The run's result; never raises for anything the program does.
        """
        with tempfile.TemporaryDirectory(prefix="mgspo-sandbox-", dir=self.host_dir) as host_dir:
            code_dir = Path(host_dir, "code")
            code_dir.mkdir()
            os.chmod(host_dir, 0o755)  # readable by the unprivileged user the sandbox starts as
            for name, text in files.items():
                Path(code_dir, name).write_text(text, encoding="utf-8")
            io_paths = [Path(host_dir, name) for name in ("stdin", "stdout", "stderr")]
            io_paths[0].write_bytes(stdin)
            info_read, info_write = os.pipe()  # bwrap reports the sandbox's first process here
            os.set_blocking(info_read, False)
            with (
                open(io_paths[0], "rb") as fin,
                open(io_paths[1], "wb") as fout,
                open(io_paths[2], "wb") as ferr,
            ):
                start = time.perf_counter()
                try:
                    proc = subprocess.Popen(
                        self.command(str(code_dir), argv, limits, info_write),
                        stdin=fin,
                        stdout=fout,
                        stderr=ferr,
                        start_new_session=True,  # its own process group, killed as one
                        pass_fds=(info_write,),
                        **self.popen_user(),
                    )
                finally:
                    os.close(info_write)
                try:
                    timed_out = not _exits_within(proc, limits.wall_s)
                finally:
                    _kill_group(proc)
                    _wait_for_namespace(info_read)
                wall = time.perf_counter() - start
            cap = limits.file_size_mb << 20
            stdout = _read_head(io_paths[1], cap)
            stderr = _read_head(io_paths[2], 1 << 16).decode("utf-8", "replace")[-2000:]
        return RunResult(_status(proc.returncode, timed_out), proc.returncode, stdout, stderr, wall)


def _read_head(path: Path, limit: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(limit)


def _exits_within(proc: subprocess.Popen, seconds: float) -> bool:
    """Whether `proc` exits within `seconds`: woken by its pidfd, not by `Popen.wait`'s polling sleeps."""
    pidfd = os.pidfd_open(proc.pid)
    try:
        return _readable_within(pidfd, seconds)
    finally:
        os.close(pidfd)


def _readable_within(fd: int, seconds: float) -> bool:
    """poll, not select: a trainer or a test process can hold more than select's 1,024 descriptors."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(seconds * 1000))


def _wait_for_namespace(info_read: int) -> None:
    """Wait until the sandbox's PID-namespace init has exited, and with it every process inside.

    When a namespace's init dies the kernel kills the rest and the init's exit completes only
    after they are gone, so once its pidfd is readable nothing of the run is left. bwrap writes
    the init's host PID as `child-pid` to its info fd; without one (no bwrap) there is nothing
    to wait for.
    """
    try:
        info = os.read(info_read, 4096)
    except BlockingIOError:
        info = b""
    finally:
        os.close(info_read)
    match = re.search(rb'"child-pid":\s*(\d+)', info)
    if match is None:
        return
    try:
        pidfd = os.pidfd_open(int(match.group(1)))
    except ProcessLookupError:
        return  # already gone
    try:
        _readable_within(pidfd, 10.0)  # readable once it has exited; bounded, never hangs the pool
    finally:
        os.close(pidfd)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (whatever is left of it) and reap the leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class BubblewrapSandbox(_Runner):
    """Runs programs under bubblewrap (see the module docstring).

    Args:
        bwrap: the bubblewrap executable (default: `bwrap` on PATH).
        python: the interpreter programs run with (default: `base_python()`, the system's python3,
            so no virtual environment's packages are inside).
        host_dir: where each run's files (code, input, output) are kept on the host, in a
            directory of their own removed after the run (default: the system's temp dir). As
            root it must be reachable by `nobody`.

    Raises:
        SandboxUnavailableError: bubblewrap or prlimit is missing, or cannot create the namespaces.
    """

    def __init__(self, bwrap: str | None = None, python: str | None = None, host_dir: str | None = None):
        self.bwrap = bwrap or shutil.which("bwrap")
        self.prlimit = shutil.which("prlimit")
        if self.bwrap is None:
            raise SandboxUnavailableError(f"no bubblewrap (bwrap) on PATH: {INSTALL_HINT}")
        if self.prlimit is None:
            raise SandboxUnavailableError("no prlimit on PATH: install util-linux")
        self.python, self.host_dir = python or base_python(), host_dir
        self.binds = _system_binds(self.python)
        probe = self.run({}, [self.python, "-c", _VERSION_PROBE], b"", Limits(wall_s=30.0))
        if probe.status is not RunStatus.OK:
            raise SandboxUnavailableError(
                f"bubblewrap at {self.bwrap} cannot start a sandbox here (exit {probe.returncode}): "
                f"{probe.stderr.strip()[-500:]} (task.options.python chooses the interpreter)"
            )
        self.version = _parse_version(probe.stdout)

    def popen_user(self) -> dict:
        """As root, start bwrap as `nobody`: root's own processes ignore the process-count limit.

        bwrap itself starts with an allow-listed environment: the sandbox's pid 1 is bwrap's
        fork, and `/proc/1/environ` inside shows the environment bwrap was started with (the
        trainer's API keys, were it inherited); `--clearenv` only cleans the program's.
        """
        env = {"env": dict(SANDBOX_ENV)}
        if os.geteuid() != 0:
            return env
        return {**env, "user": _NOBODY, "group": _NOBODY, "extra_groups": []}

    def command(self, code_dir: str, argv: list[str], limits: Limits, info_fd: int) -> list[str]:
        """The bwrap command line of one run."""
        cmd = [
            self.bwrap,
            "--info-fd",
            str(info_fd),
            "--unshare-all",
            "--unshare-user",
            "--die-with-parent",
            "--new-session",
        ]
        cmd += ["--cap-drop", "ALL", "--disable-userns", "--uid", "65534", "--gid", "65534"]
        cmd += ["--hostname", "sandbox", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin"]
        cmd += ["--setenv", "HOME", WORK_DIR, "--setenv", "LANG", "C.UTF-8"]
        for path in self.binds:
            cmd += ["--ro-bind", path, path]
        cmd += ["--dev", "/dev", "--proc", "/proc"]
        cmd += ["--size", str(limits.disk_mb << 20), "--perms", "1777", "--tmpfs", WORK_DIR]
        cmd += ["--ro-bind", code_dir, CODE_DIR, "--remount-ro", "/", "--chdir", WORK_DIR]
        return [*cmd, "--", self.prlimit, *limits.prlimit_args(), "--", *argv]


class UnsandboxedRunner(_Runner):
    """`sandbox: none`: the limits and the process-group kill, without namespaces (the host is exposed)."""

    def __init__(self, python: str | None = None):
        self.python = python or base_python()
        self.prlimit = shutil.which("prlimit")
        probe = subprocess.run([self.python, "-c", _VERSION_PROBE], capture_output=True, timeout=30)
        self.version = _parse_version(probe.stdout)

    def command(self, code_dir: str, argv: list[str], limits: Limits, info_fd: int) -> list[str]:
        """`argv` with its code paths pointed at the host directory, under prlimit when available."""
        argv = [arg.replace(CODE_DIR + "/", code_dir + "/") for arg in argv]
        return [self.prlimit, *limits.prlimit_args(), "--", *argv] if self.prlimit else argv


_VERSION_PROBE = "import sys; print(*sys.version_info[:2])"


def _parse_version(stdout: bytes) -> tuple[int, int] | None:
    parts = stdout.split()
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 and all(p.isdigit() for p in parts) else None


def base_python() -> str:
    """The interpreter programs run with by default: the system's /usr/bin/python3 when there is one.

    Otherwise this Python's base installation (outside any virtual environment), resolved; as
    root it must sit where `nobody` can read it (not under /root).
    """
    if os.path.exists("/usr/bin/python3"):
        return os.path.realpath("/usr/bin/python3")
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _system_binds(python: str) -> list[str]:
    """Host directories a Python program needs, read-only: system dirs and the interpreter's prefix."""
    wanted = [
        "/usr",
        "/bin",
        "/sbin",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/etc/alternatives",
        "/etc/ld.so.cache",
    ]
    if not python.startswith("/usr/"):
        wanted.append(str(Path(python).parent.parent))  # e.g. /opt/python3.11
    seen, binds = set(), []
    for path in wanted:
        if os.path.lexists(path) and path not in seen:
            seen.add(path)
            binds.append(path)
    return binds


@functools.cache
def sandbox_runner(kind: str, python: str | None = None) -> _Runner:
    """The runner for `task.options.sandbox` ("bwrap" or "none"), built and probed once per process.

    Args:
        kind: "bwrap" or "none".
        python: the interpreter programs run with (None: `base_python()`).

    Raises:
        SandboxUnavailableError: "bwrap" on a machine where bubblewrap cannot run.
        ValueError: an unknown kind.
    """
    if kind == "bwrap":
        return BubblewrapSandbox(python=python)
    if kind == "none":
        return UnsandboxedRunner(python=python)
    raise ValueError(f"sandbox must be 'bwrap' or 'none', got {kind!r}")
