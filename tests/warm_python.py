"""A Python that has imported torch, megatron-core, transformers and this package, to fork from.

Most of a slow test's CPU is interpreter start-up: each embedded server, `train`, `export` or
`parity` a test starts imports torch, transformers and megatron-core afresh (~5-7 s of CPU on a
2-core box, ~1.5x that on 3.12's CUDA build of torch). Each pytest worker starts one warm server
(`tests/conftest.py`); `python()` is the command that runs `python -m MODULE ...` or
`python SCRIPT ...` as a process forked from it instead:

- `warm_python_client.py` connects over a Unix socket and hands over its stdin, stdout and
  stderr, its arguments, environment and working directory. The forked child takes them and runs
  the module or script as `__main__` (`runpy`, as `python -m` does), in its own process group.
- The client stands in for the child as the test's process: it forwards SIGTERM, SIGINT, SIGHUP,
  SIGQUIT and SIGUSR1/2 to it and exits as the child did (with its code, or by its signal). If
  the client dies (a timeout's SIGKILL), the server kills the child.
- A request the fork cannot serve exactly runs a fresh interpreter instead (the client `exec`s
  it): interpreter options (`-c`, `-u`, `-X ...`), or a start-up variable (`PYTHONPATH`,
  `OMP_NUM_THREADS`, `HF_*`, `TORCH_LOGS`, ...) whose value differs from the server's, since those
  act, or are cached, while Python, torch and transformers load.

What a fork does not reproduce: the child's parent is the server, not the test (so the embedded
servers' parent watch follows the launcher's pid, `rollout/parent_watch.py`), and it sees the
modules below already imported. Tests of process structure, signals to a launcher and import
floors start fresh interpreters (`sys.executable`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import runpy
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

from warm_python_client import SOCKET_VAR, startup_fingerprint

from megatron_gspo.python_command import PYTHON_VAR  # what the project runs its Python programs with

CLIENT = Path(__file__).with_name("warm_python_client.py")
# Imported once by the server. First the module that silences megatron-core's import-time
# warnings about TransformerEngine and apex, as a fresh process does before importing it.
PRELOAD = (
    "megatron_gspo.model.distributed",
    "megatron_gspo.training.forkserver_preload",
    "megatron_gspo.cli",
    "megatron_gspo.training.launch",
    "megatron_gspo.rollout.parent_watch",
    "megatron_gspo.rollout.server.main",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
)


def python() -> list[str]:
    """The command to use as `python` for a test's process: the warm client where one serves."""
    if os.environ.get(SOCKET_VAR):
        return [sys.executable, "-I", "-S", str(CLIENT)]
    return [sys.executable]


def kill_server(server) -> None:
    """SIGKILL an embedded server (`EmbeddedServer`) and wait until its port refuses connections.

    Under a warm Python the test's process is the client, and the server it stands for dies a
    moment after it: a test that kills a worker waits for the worker, not for its client.
    """
    server.process.kill()
    server.process.wait()
    address = urllib.parse.urlsplit(server.url)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection((address.hostname, address.port), timeout=1).close()
        except OSError:
            return
        time.sleep(0.01)
    raise TimeoutError(f"the server at {server.url} still answers 30 s after its SIGKILL")


# --- the server ---------------------------------------------------------------------------------


def _receive(conn: socket.socket) -> tuple[dict, list[int]] | None:
    """One request: an 8-byte length, then JSON, sent with the client's fds 0, 1 and 2."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    if len(data) < 8 or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return None
    size = int.from_bytes(data[:8], "big")
    body = bytearray(data[8:])
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None
        body += chunk
    return json.loads(body), fds


def serve(path: str) -> tuple[dict, list[int]]:
    """Fork a child per request until killed; returns only in a child, with its request.

    A client that goes away mid-request costs its request, never the server.
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    clients: dict[int, tuple[socket.socket, int]] = {}  # child pid -> (its client's connection, pidfd)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request = _receive(conn)
                except (OSError, ValueError):
                    request = None
                if request is None:
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for other, pidfd in clients.values():
                        other.close()
                        os.close(pidfd)
                    conn.close()
                    return request
                for fd in request[1]:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                clients[pid] = (conn, pidfd)
                selector.register(pidfd, selectors.EVENT_READ, ("exited", pid))
                selector.register(conn, selectors.EVENT_READ, ("client", pid))
                with contextlib.suppress(OSError):  # a client gone already is seen as its EOF below
                    conn.sendall(f"{pid}\n".encode())
            elif key.data[0] == "exited":
                pid = key.data[1]
                conn, pidfd = clients.pop(pid)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                if conn.fileno() >= 0:
                    selector.unregister(conn)
                    with contextlib.suppress(OSError):
                        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    conn.close()
            else:  # the client said nothing more, so it is gone: its child goes too
                pid = key.data[1]
                with contextlib.suppress(OSError):
                    if key.fileobj.recv(1):
                        continue
                selector.unregister(key.fileobj)
                key.fileobj.close()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def become(request: dict, fds: list[int]) -> None:
    """In the forked child: take the client's stdio, environment and directory, then run its command."""
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # found again from TMPDIR on first use, as in a fresh process
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=unbuffered or stream.isatty(), write_through=unbuffered)
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    import numpy

    numpy.random.seed()  # a fresh process's global generator is seeded from the OS, not inherited
    args = request["argv"]
    if args[0] == "-m":
        module = args[1]
        sys.argv = [module, *args[2:]]
        sys.path[0] = os.getcwd()
        sys.modules.pop(module, None)  # run as `__main__`, as `python -m` does, not the imported copy
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = os.path.realpath(args[0])
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


# --- what the tests' conftest starts ------------------------------------------------------------


class WarmServer:
    """This pytest process's warm server: `python()` and the embedded servers use it while it runs.

    Started without waiting: until it listens (~7 s of imports), a client runs a fresh interpreter.
    """

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="megatron-gspo-warm-")
        self.path = os.path.join(self.directory, "warm.sock")
        ours = (SOCKET_VAR, PYTHON_VAR)
        env = {name: value for name, value in os.environ.items() if name not in ours}
        env["PYTHONUNBUFFERED"] = "1"
        Path(self.path + ".json").write_text(json.dumps(startup_fingerprint(env)))
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), self.path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # a child's stray killpg never reaches pytest
        )
        os.environ[SOCKET_VAR] = self.path
        os.environ[PYTHON_VAR] = shlex.join(python())

    def stop(self) -> None:
        os.environ.pop(SOCKET_VAR, None)
        os.environ.pop(PYTHON_VAR, None)
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def run_as_main(request: dict, fds: list[int]) -> None:
    """Run the child's command, then end as an interpreter does, less its teardown of every module.

    That teardown touches each object the server imported, copying every shared page (~1.4 s per
    child); exiting after the non-daemon threads, the `atexit` functions and a flush is what
    remains of it that a program can see.
    """
    code, interrupted = 0, False
    try:
        become(request, fds)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as error:
        sys.excepthook(type(error), error, error.__traceback__)
        code, interrupted = 1, isinstance(error, KeyboardInterrupt)
    threading._shutdown()  # what the interpreter does first at exit: join non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:  # as Python ends on an unhandled Ctrl-C: by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


if __name__ == "__main__":
    from megatron_gspo.rollout.parent_watch import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)  # gone with the pytest worker that started it
    if os.getppid() == 1:  # it was gone already
        os._exit(1)
    for name in PRELOAD:
        __import__(name)
    sys.path[0] = ""  # not this file's folder: each child sets its own
    gc.freeze()  # a child's collections then leave the server's objects, and their pages, alone
    run_as_main(*serve(sys.argv[1]))
