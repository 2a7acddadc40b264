"""Start the embedded rollout server as a subprocess and wait until it is healthy.

    with launch_embedded_server("/tmp/tiny_ckpt") as server:
        httpx.post(f"{server.url}/generate", json={...})

The child binds port 0 (the OS picks a free port, no race) unless a port is given, and
announces the port on its first stdout line; the launcher then polls GET /health. The child
runs under `parent_watch`, so it exits by itself when the launching process dies, even by
SIGKILL (no orphaned server holding memory and a port).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from megatron_gspo.python_command import python_command

_ANNOUNCE = re.compile(r"listening on (http://\S+)")


class EmbeddedServer:
    """Handle of a running server subprocess; a context manager that terminates it on exit."""

    def __init__(self, process: subprocess.Popen, output_tail: collections.deque) -> None:
        self.process = process
        self.url = ""
        self._tail = output_tail

    @property
    def output(self) -> str:
        """The last lines the server printed (stdout and stderr), for error reports."""
        return "".join(self._tail)

    def generated_tokens(self) -> int:
        """Output tokens the server has decoded since start (/get_server_info's `num_generated_tokens`)."""
        return int(httpx.get(f"{self.url}/get_server_info", timeout=30).json()["num_generated_tokens"])

    def wait_for_tokens(self, count: int, *, timeout: float = 120.0) -> int:
        """Block until the server has decoded at least `count` output tokens since start.

        How a caller lands something (a pause, a weight sync) after a generation's first tokens
        rather than after a guessed sleep: read `generated_tokens()` before starting it, then wait
        for that plus N.

        Returns:
            The count reached (>= `count`).

        Raises:
            TimeoutError: not reached within `timeout` s (a hang guard, not a measurement).
            RuntimeError: the server exited.
        """
        deadline = time.monotonic() + timeout
        while (done := self.generated_tokens()) < count:
            if self.process.poll() is not None:
                raise RuntimeError(f"embedded server exited with {self.process.returncode}:\n{self.output}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{done} of {count} tokens generated after {timeout} s")
            time.sleep(0.005)
        return done

    def terminate(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout` s)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.terminate()


def launch_embedded_server(
    model_dir: str | os.PathLike,
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    num_threads: int | None = 1,
    timeout: float = 120.0,
    exit_with_parent: bool = True,
    env: Mapping[str, str] | None = None,
    enable_memory_saver: bool = False,
    kv_pool_mb: float = 0.0,
) -> EmbeddedServer:
    """Start `python -m megatron_gspo.rollout.server` on `model_dir` and wait until /health answers.

    Args:
        model_dir: HF checkpoint directory to serve.
        port: TCP port; None lets the OS choose a free one.
        host: Bind address.
        extra_args: More `serve` arguments, e.g. ("--return-original-logprob", "--check-responses").
        num_threads: torch intra-op threads of the server (OMP_NUM_THREADS); None inherits.
        timeout: Seconds to wait for health.
        exit_with_parent: the server exits when this process dies (a parent watch, plus Linux's
            parent-death signal when called from the main thread: that signal fires when the
            launching *thread* ends).
        env: more environment variables of the server, e.g. ``{"SGLANG_HEALTH_CHECK_TIMEOUT": "2"}``
            (SGLang's, which the server reads as SGLang does).
        enable_memory_saver: serve `/release_memory_occupation` and `/resume_memory_occupation`
            (SGLang's `--enable-memory-saver`; a colocated run needs it).
        kv_pool_mb: MiB the server reserves for its KV cache pool, released with tag `kv_cache`.

    Returns:
        The running server; `.url` is its base URL.

    Raises:
        RuntimeError: the server exited or did not become healthy in time (with its output).
    """
    if not Path(model_dir, "config.json").exists():
        raise FileNotFoundError(f"{model_dir} is not an HF checkpoint directory (no config.json)")
    cmd = python_command()
    if exit_with_parent:
        cmd += ["-m", "megatron_gspo.rollout.parent_watch", "--parent-pid", str(os.getpid())]
        if threading.current_thread() is threading.main_thread():
            cmd.append("--death-signal")
    cmd += ["-m", "megatron_gspo.rollout.server", "--model", str(model_dir)]
    cmd += ["--host", host, "--port", str(port if port is not None else 0), *extra_args]
    cmd += memory_saver_args(enable_memory_saver, kv_pool_mb)
    env = {**os.environ, **(env or {})}
    if num_threads is not None:
        env["OMP_NUM_THREADS"] = str(num_threads)
    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1
    )
    tail: collections.deque = collections.deque(maxlen=200)
    announced: list[str] = []
    got_url = threading.Event()

    def drain() -> None:  # keep reading so the child never blocks on a full pipe
        for line in process.stdout:
            tail.append(line)
            match = _ANNOUNCE.search(line)
            if match and not announced:
                announced.append(match.group(1))
                got_url.set()
        got_url.set()

    threading.Thread(target=drain, name="embedded-server-output", daemon=True).start()
    server = EmbeddedServer(process, tail)
    deadline = time.monotonic() + timeout
    try:
        if not got_url.wait(timeout) or not announced:
            raise RuntimeError(f"embedded server did not start ({' '.join(cmd)}):\n{server.output}")
        server.url = announced[0]
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise RuntimeError(f"embedded server exited with {process.returncode}:\n{server.output}")
                try:
                    if client.get(f"{server.url}/health").status_code == 200:
                        return server
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"embedded server at {server.url} not healthy after {timeout} s:\n{server.output}")
    except BaseException:
        server.terminate()
        raise


def memory_saver_args(enable_memory_saver: bool, kv_pool_mb: float = 0.0) -> list[str]:
    """The `serve` arguments of SGLang's memory occupation API and of the KV pool reservation."""
    args = ["--enable-memory-saver"] if enable_memory_saver else []
    return args + (["--kv-pool-mb", f"{kv_pool_mb:g}"] if kv_pool_mb > 0 else [])
