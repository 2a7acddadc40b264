"""Fleets behind SGLang's router at launch: config checks, the launch scripts' commands, `plan`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_in_process import run_cli_in_process

pytestmark = pytest.mark.slow  # plan and both launch scripts' dry runs: ~36 s

ROOT = Path(__file__).resolve().parents[1]
PATH = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def plan(*args):
    return run_cli_in_process("plan", *args)


def script(name, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("CONFIG", "DP", "TP", "PYTORCH_CUDA_ALLOC_CONF")}
    return subprocess.run(
        ["bash", f"launch/{name}", *env.pop("args", [])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**base, "PATH": PATH, "DRY_RUN": "1", **env},
        timeout=120,
    )


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["rollout.router_url=http://r:1", "rollout.server_urls=[http://a:1]"], "both set"),
        (["rollout.router_url=r:30000"], "rollout.router_url: 'r:30000' is not an http(s) URL"),
        (["rollout.min_workers=0"], "rollout.min_workers must be >= 1, got 0"),
        (["rollout.router_url=http://r:1", "weight_sync.method=tensor"], "weight_sync.method=tensor"),
    ],
)
def test_router_settings_refused_by_name(overrides, needle):
    result = plan("--config", "configs/tiny_moe_cpu.yaml", "--world-size", "1", *overrides)
    assert result.returncode == 2, result.stdout + result.stderr
    assert needle in result.stderr and result.stderr.count("\n") <= 2, result.stderr


def test_fleet_config_fits_two_training_nodes(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text('{"problem": "What is $1+1$?", "answer": "2"}\n')
    result = plan(
        "--config",
        "configs/qwen3_30b_a3b_gspo_fleet.yaml",
        "--world-size",
        "16",
        f"task.options.path={data}",
        "rollout.router_url=http://rollout-0:30100",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fits" in result.stdout


def test_sglang_servers_starts_the_router_in_front_of_every_server():
    result = script(
        "sglang_servers.sh",
        MODEL="/ckpt/m",
        TP="4",
        DP="2",
        HOST="10.0.0.7",
        ROUTER="1",
        ROUTER_WORKERS="http://n1:30000,http://n1:30001",
    )
    assert result.returncode == 0, result.stderr
    assert "rollout router URL: http://10.0.0.7:30100" in result.stdout
    router = next(line for line in result.stdout.splitlines() if line.startswith("would run router: "))
    assert router.endswith(
        "--worker-urls http://10.0.0.7:30000 http://10.0.0.7:30001 http://n1:30000 http://n1:30001"
    )
    assert "-m sglang_router.launch_router --host 10.0.0.7 --port 30100" in router


def test_train_launcher_meets_over_c10d_and_points_at_the_router(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text('{"problem": "What is $1+1$?", "answer": "2"}\n')
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "trainer-0", "DATA": str(data)}
    result = script(
        "train_h100.sh",
        args=["configs/qwen3_30b_a3b_gspo_fleet.yaml"],
        SGLANG_ROUTER="http://r0:30100",
        **env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torchrun --nnodes 2 --node_rank 1 --nproc_per_node 8 --rdzv-backend c10d" in result.stdout
    assert "--rdzv-endpoint trainer-0:29500 --rdzv-id qwen3_30b_a3b_gspo_fleet" in result.stdout
    assert "rollout.router_url=http://r0:30100" in result.stdout and "fits" in result.stdout
    both = script(
        "train_h100.sh",
        args=["configs/qwen3_30b_a3b_gspo_fleet.yaml"],
        SGLANG_ROUTER="http://r0:30100",
        SGLANG_URLS="http://a:1",
        **env,
    )
    assert both.returncode == 2 and "not both" in both.stderr
