"""`python ARGS` as a child forked from the warm server (`tests/warm_python.py`), or fresh.

Run as `python -I -S warm_python_client.py ARGS`: it imports nothing outside the standard library,
so it starts in a few milliseconds. See `warm_python.py` for what it does and when it falls back
to `exec`ing a fresh interpreter with the same arguments.
"""

import json
import os
import signal
import socket
import sys

SOCKET_VAR = "MEGATRON_GSPO_WARM_PYTHON"
# Read while the interpreter, torch, transformers or megatron-core start (and cached): a child
# whose values of these differ from the server's runs fresh. Those a child can apply itself are
# applied (`warm_python.become`): PYTHONUNBUFFERED, PYTHONFAULTHANDLER, PYTHONDONTWRITEBYTECODE,
# TMPDIR. (Not every TORCH*: torch sets TORCHINDUCTOR_CACHE_DIR in the tests' process when it
# compiles.)
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "HF_", "TRANSFORMERS_", "LD_")
STARTUP_NAMES = ("TORCH_LOGS", "TORCH_CPP_LOG_LEVEL", "CUDA_VISIBLE_DEVICES", "CUDA_HOME")
APPLIED_IN_CHILD = ("PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE")
FORWARDED_SIGNALS = (
    signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
)  # fmt: skip


def startup_fingerprint(env) -> dict[str, str]:
    """The start-up variables of `env` (a mapping) that a forked child cannot apply itself."""
    return {
        name: value
        for name, value in env.items()
        if (name.startswith(STARTUP_PREFIXES) or name in STARTUP_NAMES) and name not in APPLIED_IN_CHILD
    }


def _forkable(args: list[str], path: str | None) -> bool:
    if not path or not args:
        return False
    if not (len(args) >= 2 and args[0] == "-m") and not (args[0].endswith(".py") and os.path.isfile(args[0])):
        return False  # interpreter options (-c, -u, -X ...) need a fresh interpreter
    try:
        with open(path + ".json") as f:
            return json.load(f) == startup_fingerprint(os.environ)  # the server's, written by it
    except OSError:
        return False


def _run_fresh(args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *args])


def main() -> None:
    args = sys.argv[1:]
    path = os.environ.get(SOCKET_VAR)
    if not _forkable(args, path):
        _run_fresh(args)
    pending: list[int] = []
    child: list[int] = []

    def forward(signum, frame):
        if child:
            try:
                os.kill(child[0], signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:  # the server is gone (the session is ending): run it the slow way
        _run_fresh(args)
    body = json.dumps({"argv": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    message = len(body).to_bytes(8, "big") + body
    sent = socket.send_fds(sock, [message], [0, 1, 2])
    sock.sendall(message[sent:])
    replies = sock.makefile("r")
    line = replies.readline()
    if not line:
        sys.exit(f"warm Python server at {path} refused {args}")
    child.append(int(line))
    for signum in pending:
        os.kill(child[0], signum)
    line = replies.readline()
    if not line:  # the server died: take the child with it rather than leave it unsupervised
        try:
            os.kill(child[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(f"warm Python server at {path} went away while running {args}")
    code = int(line)
    if code < 0:  # ended by a signal: end the same way, so the test sees what a fresh process gives
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # the two that cannot be caught
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
