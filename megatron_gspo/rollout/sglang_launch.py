"""Start real SGLang servers (`python -m sglang.launch_server`) for a run, and stop them with it.

    with launch_sglang_server("/tmp/tiny_ckpt", log_path="run/sglang/server-0.log") as server:
        SGLangClient([server.url])

SGLang runs in an environment of its own (it pins its torch: launch/setup_sglang.sh makes
`.venv-sglang`), under `parent_watch`, in a session of its own: it spawns a scheduler and a
detokenizer, so it is stopped by signalling its whole process group, and it exits by itself
when the launching process dies, even by SIGKILL. Its output goes to a log file, whose tail an
error names. On a host without CUDA the server runs SGLang's CPU engine (`--device cpu`,
`SGLANG_USE_CPU_ENGINE=1`, docs/sglang-on-cpu.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from megatron_gspo.rollout import parent_watch

REPO = Path(__file__).resolve().parents[2]
PYTHON_VAR = "MEGATRON_GSPO_SGLANG_PYTHON"
DEFAULT_VENV = REPO / ".venv-sglang"
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph")
"""SGLang's CPU engine: torch-native attention, and no CUDA graphs (decode is ~3x slower with them)."""
LOG_TAIL_LINES = 40


def sglang_python() -> str:
    """The interpreter SGLang runs with: `$MEGATRON_GSPO_SGLANG_PYTHON`, else `.venv-sglang`'s."""
    return os.environ.get(PYTHON_VAR) or str(DEFAULT_VENV / "bin" / "python")


def sglang_unavailable() -> str | None:
    """None when SGLang's interpreter exists, else why not (an error's or a skip's reason)."""
    python = sglang_python()
    if not Path(python).exists():
        return f"no SGLang interpreter at {python}: run launch/setup_sglang.sh (or set {PYTHON_VAR})"
    return None


class SGLangServer:
    """A running SGLang server: its URL, process (a session leader) and log file."""

    def __init__(self, process: subprocess.Popen, url: str, log_path: Path) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of the server's log (for error reports)."""
        with contextlib.suppress(OSError):
            return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
        return ""

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server (it stops its scheduler itself), SIGKILL its process group after `timeout` s."""
        if self.process.poll() is None:
            self.process.terminate()  # a scheduler signalled first would "crash" and stall exit 5 s
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # The scheduler and detokenizer may outlive the launcher process: kill what is left.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def __enter__(self) -> SGLangServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def server_command(
    model_dir: str | os.PathLike,
    *,
    host: str,
    port: int,
    device: str,
    max_total_tokens: int,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """`sglang.launch_server`'s arguments for `model_dir` (device cpu: the CPU engine's flags)."""
    cmd = ["-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", host, "--port", str(port)]
    cmd += ["--max-total-tokens", str(max_total_tokens)]  # else the KV pool takes most of the RAM
    cmd += list(CPU_FLAGS) if device == "cpu" else ["--device", device]
    return cmd + list(extra_args)


def server_environment(device: str, num_threads: int | None, env: Mapping[str, str] | None) -> dict[str, str]:
    """The server's environment: the CPU engine's switch on CPU, its thread count, `env` on top."""
    out = dict(os.environ)
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):  # the trainer's, not SGLang's
        out.pop(name, None)
    if device == "cpu":
        out["SGLANG_USE_CPU_ENGINE"] = "1"
    if num_threads is not None:
        out["OMP_NUM_THREADS"] = str(num_threads)
    return {**out, **(env or {})}


def launch_sglang_server(
    model_dir: str | os.PathLike,
    *,
    log_path: str | os.PathLike,
    host: str = "127.0.0.1",
    port: int | None = None,
    device: str = "cpu",
    max_total_tokens: int = 4096,
    extra_args: Sequence[str] = (),
    num_threads: int | None = 1,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> SGLangServer:
    """Start SGLang on `model_dir` and wait until its /health answers 200.

    Args:
        model_dir: HF checkpoint directory to serve.
        log_path: file the server's stdout and stderr go to (its directory is created).
        host: bind address.
        port: TCP port; None picks a free one.
        device: SGLang's --device; cpu runs its CPU engine.
        max_total_tokens: the KV pool's size in tokens.
        extra_args: more `launch_server` arguments (e.g. --enable-return-routed-experts).
        num_threads: the server's torch threads (OMP_NUM_THREADS); None inherits.
        timeout: seconds to wait for health (start-up is 20-70 s on a 2-core CPU box).
        env: more environment variables of the server.

    Raises:
        RuntimeError: no SGLang interpreter, or the server exited or did not become healthy in
            time (with its log's tail).
    """
    if (missing := sglang_unavailable()) is not None:
        raise RuntimeError(missing)
    if not Path(model_dir, "config.json").exists():
        raise FileNotFoundError(f"{model_dir} is not an HF checkpoint directory (no config.json)")
    port = port or _free_port(host)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # -P: the watch runs by file path (SGLang's environment has no megatron_gspo) and its folder,
    # which holds a types.py, must not shadow the standard library.
    cmd = [sglang_python(), "-P", parent_watch.__file__, "--parent-pid", str(os.getpid())]
    if threading.current_thread() is threading.main_thread():
        cmd.append("--death-signal")
    cmd += server_command(
        model_dir,
        host=host,
        port=port,
        device=device,
        max_total_tokens=max_total_tokens,
        extra_args=extra_args,
    )
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_environment(device, num_threads, env),
            start_new_session=True,
        )
    server = SGLangServer(process, f"http://{host}:{port}", log_path)
    try:
        _wait_healthy(server, timeout)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_healthy(server: SGLangServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0, trust_env=False) as http:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(
                    f"SGLang server exited with {server.process.returncode} "
                    f"(log {server.log_path}):\n{server.log_tail()}"
                )
            with contextlib.suppress(httpx.TransportError):
                if http.get(f"{server.url}/health").status_code == 200:
                    return
            time.sleep(0.5)
    raise RuntimeError(
        f"SGLang server at {server.url} not healthy after {timeout} s "
        f"(log {server.log_path}):\n{server.log_tail()}"
    )


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
