"""`megatron-gspo plan` and the H100 launch scripts, dry-run on CPU: the large configs validate and fit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.model import config as presets
from megatron_gspo.model.builder import EngineConfig
from megatron_gspo.model.distributed import ParallelConfig
from megatron_gspo.plan import GIB, shard_plan

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def math_data(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text('{"problem": "What is $1+1$?", "answer": "2"}\n')
    return path


def plan(*args):
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "plan", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_shard_plan_counts_by_hand():
    model = presets.tiny(vocab_size=80)  # 2 layers, H=64, 8 experts of 3 * 64 * 32 weights
    expert = 2 * 8 * 3 * 64 * 32
    parallel = ParallelConfig(tensor_parallel=2, expert_parallel=4, distributed_optimizer=True)
    result = shard_plan(model, parallel, EngineConfig(dtype="bf16"), world_size=8)
    assert result.expert_params == expert // 8
    assert result.dense_params == (model.num_parameters - expert) // 2
    local = result.expert_params + result.dense_params
    assert result.weight_bytes == 2 * local and result.grad_bytes == 4 * local
    # Adam moments + fp32 master: 12 bytes, sharded over the 8 / TP2 = 4 dense data-parallel replicas;
    # experts fill the world (EP4 x expert-TP2 = 8), so their optimizer states are not sharded.
    assert result.optimizer_bytes == int(result.dense_params * 12 / 4 + result.expert_params * 12 / 1)


@pytest.mark.parametrize(
    "config,world,max_gib",
    [("qwen3_30b_a3b_gspo", 16, 50), ("qwen3_30b_a3b_grpo_r2", 16, 50), ("qwen3_235b_a22b_gspo", 128, 60)],
)
def test_large_configs_validate_and_fit_on_h100(config, world, max_gib, math_data):
    result = plan(
        "--config", f"configs/{config}.yaml", "--world-size", str(world), f"task.options.path={math_data}"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fits" in result.stdout
    total = float(result.stdout.split(" GiB = ")[1].split(" GiB")[0])
    assert 10 < total < max_gib


def test_plan_refuses_a_layout_that_does_not_fit(math_data):
    result = plan(
        "--config",
        "configs/qwen3_235b_a22b_gspo.yaml",
        "--world-size",
        "128",
        f"task.options.path={math_data}",
        "parallel.expert_parallel=8",
        "parallel.distributed_optimizer=false",
    )
    assert result.returncode == 1 and "DOES NOT FIT" in result.stdout, result.stdout + result.stderr


def test_plan_names_an_impossible_world_size(math_data):
    result = plan(
        "--config", "configs/qwen3_30b_a3b_gspo.yaml", "--world-size", "12", f"task.options.path={math_data}"
    )
    assert result.returncode == 2
    assert "config error: parallel: impossible layout for 12 process(es)" in result.stderr


def test_train_launcher_dry_run(math_data):
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "NNODES": "2",
        "DATA": str(math_data),
        "SGLANG_URLS": "http://a:1,http://b:2",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    result = subprocess.run(
        ["bash", "launch/train_h100.sh", "configs/qwen3_30b_a3b_gspo.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torchrun --nnodes 2 --node_rank 0 --nproc_per_node 8" in result.stdout
    assert "rollout.server_urls=[http://a:1,http://b:2]" in result.stdout
    assert "on 16 ranks" in result.stdout and "fits" in result.stdout


def test_sglang_launcher_dry_run():
    env = {**os.environ, "DRY_RUN": "1", "MODEL": "/ckpt/Qwen3-30B-A3B", "TP": "4"}
    result = subprocess.run(
        ["bash", "launch/sglang_servers.sh"], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert result.returncode == 0
    assert "--enable-return-routed-experts" in result.stdout and "--tp-size 4" in result.stdout


def test_gpu_engine_settings_load_on_cpu_but_refuse_to_build():
    engine = EngineConfig(dtype="bf16", use_te=True, fused_kernels=True)
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ValueError, match="bf16 needs a GPU"):
            engine.check_hardware()
    assert GIB == 1024**3
