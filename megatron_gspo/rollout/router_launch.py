"""Start SGLang's router (pip `sglang-router`, a Rust binary) in front of rollout workers.

    with launch_router(["http://127.0.0.1:30001", "http://127.0.0.1:30002"]) as router:
        SGLangClient([], router_url=router.url)

The router renames its process (`sglang::router`), so it is found by its process group, not
by name: it starts in a session of its own and is stopped by signalling that whole group
(SIGTERM, then SIGKILL). It runs under `parent_watch`, so it also exits when the launching
process dies, even by SIGKILL. The launcher returns once the router lists every given worker
as healthy at `GET /workers`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import httpx

ROUTER_MODULE = "sglang_router.launch_router"
PORT_ATTEMPTS = 3
ADDRESS_IN_USE = "Address already in use"


def router_available() -> str | None:
    """None when the `sglang-router` wheel imports, else why not (a test's skip reason)."""
    try:
        import sglang_router.router  # noqa: F401 - the Rust extension itself
    except ImportError as err:
        return f"sglang-router is not installed ({err}); pip install -e '.[router]'"
    return None


class RouterProcess:
    """A running router: its base URL and process (a session leader: its pid is its group)."""

    def __init__(self, process: subprocess.Popen, url: str, output: collections.deque):
        self.process = process
        self.url = url
        self._output = output

    @property
    def output(self) -> str:
        """The router's last log lines (for error reports)."""
        return "".join(self._output)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the router's process group, SIGKILL it after `timeout` s."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@contextlib.contextmanager
def launch_router(
    worker_urls: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    policy: str = "cache_aware",
    extra_args: Sequence[str] = (),
    timeout: float = 60.0,
) -> Iterator[RouterProcess]:
    """Run the router in front of `worker_urls` until the block ends.

    Args:
        worker_urls: the workers' base URLs (each must answer /health, /get_model_info and
            /get_server_info as SGLang does).
        host: bind address.
        port: the router's port (None: a free one); its Prometheus port is the next free one.
        policy: the router's `--policy` (cache_aware places a prompt's requests on the worker
            that has its prefix cached).
        extra_args: more `launch_router` arguments (e.g. ``--retry-max-retries 3``).
        timeout: seconds to wait until the router lists every worker healthy.

    Raises:
        RuntimeError: the router exited or did not list the workers in time (with its log).
    """
    for attempt in range(1, PORT_ATTEMPTS + 1):
        router = _start_router(worker_urls, host, port or _free_port(), policy, extra_args)
        try:
            _wait_for_workers(router, len(worker_urls), timeout)
            break
        except RuntimeError as err:
            router.stop()
            # A port found free can be taken before the router binds it (another process's
            # ephemeral port): the ports chosen here (never the caller's) are chosen again.
            ours = port is None or "Prometheus" in str(err)
            if ADDRESS_IN_USE not in str(err) or not ours or attempt == PORT_ATTEMPTS:
                raise
    try:
        yield router
    finally:
        router.stop()


def _start_router(worker_urls, host: str, port: int, policy: str, extra_args) -> RouterProcess:
    cmd = [sys.executable, "-m", "megatron_gspo.rollout.parent_watch", "--parent-pid", str(os.getpid())]
    if threading.current_thread() is threading.main_thread():
        cmd.append("--death-signal")
    cmd += ["-m", ROUTER_MODULE, "--host", host, "--port", str(port), "--policy", policy]
    cmd += ["--prometheus-host", host, "--prometheus-port", str(_free_port())]
    cmd += ["--log-level", "warn", "--worker-urls", *worker_urls, *extra_args]
    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    output: collections.deque = collections.deque(maxlen=200)
    threading.Thread(target=lambda: output.extend(process.stdout), name="router-output", daemon=True).start()
    return RouterProcess(process, f"http://{host}:{port}", output)


def _wait_for_workers(router: RouterProcess, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0, trust_env=False) as http:
        while time.monotonic() < deadline:
            if router.process.poll() is not None:
                raise RuntimeError(f"router exited with {router.process.returncode}:\n{router.output}")
            try:
                workers = http.get(f"{router.url}/workers").json().get("workers", [])
                if sum(bool(w.get("is_healthy")) for w in workers) >= count:
                    return
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            time.sleep(0.2)
    raise RuntimeError(
        f"router at {router.url} did not list {count} healthy workers in {timeout} s:\n{router.output}"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
