"""`launch/sglang_servers.sh` warns on stderr when it binds SGLang to every interface."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _dry_run(**env):
    base = {k: v for k, v in os.environ.items() if k != "HOST"}  # the script's default unless given
    env = {**base, "DRY_RUN": "1", "MODEL": "/ckpt/Qwen3-30B-A3B", **env}
    return subprocess.run(
        ["bash", "launch/sglang_servers.sh"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )


@pytest.mark.parametrize("host", [None, "0.0.0.0", "::"])
def test_binding_every_interface_warns_on_stderr(host):
    result = _dry_run(**({"HOST": host} if host else {}))
    assert result.returncode == 0, result.stderr
    shown = host or "0.0.0.0"
    assert f"WARNING: binding SGLang to {shown}:30000, every network interface, with no authentication" in (
        result.stderr
    )
    assert f"--host {shown} " in result.stdout and "WARNING" not in result.stdout


@pytest.mark.parametrize("host", ["10.0.0.5", "127.0.0.1"])
def test_binding_one_interface_is_quiet(host):
    result = _dry_run(HOST=host)
    assert result.returncode == 0 and result.stderr == ""
    assert f"--host {host} " in result.stdout
