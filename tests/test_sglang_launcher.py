"""`launch/sglang_servers.sh`: one server per DP replica, routed experts only when the run needs them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _dry_run(**env) -> list[str]:
    """The SGLang command lines the script would run."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # python with yaml
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CONFIG", "ROUTED_EXPERTS", "QUANTIZATION", "DP", "TP", "EP")
    }
    env = {**base, "PATH": path, "DRY_RUN": "1", "MODEL": "/ckpt/m", "HOST": "127.0.0.1", **env}
    result = subprocess.run(
        ["bash", "launch/sglang_servers.sh"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if line.startswith("would run: ")]


def test_dp_replicas_are_separate_servers_on_their_own_gpus_and_ports():
    commands = _dry_run(TP="4", DP="2", PORT="31000")
    assert len(commands) == 2
    for replica, command in enumerate(commands):
        assert "--dp-size" not in command  # SGLang refuses the weight-update group at dp_size > 1
        assert f"--port {31000 + replica} " in command and "--tp-size 4 " in command
        assert f"--base-gpu-id {4 * replica} " in command


@pytest.mark.parametrize(
    ("config", "override", "expected"),
    [
        ("configs/tiny_moe_cpu.yaml", None, False),  # neither R3 nor drift
        ("configs/qwen3_30b_a3b_gspo.yaml", None, True),  # drift.enabled
        ("configs/qwen3_30b_a3b_gspo.yaml", "0", False),
        ("configs/tiny_moe_cpu.yaml", "1", True),
        (None, None, True),  # no config to read: on, as a server for any run
    ],
)
def test_routed_experts_follow_the_run_config(config, override, expected):
    env = {"CONFIG": config} if config else {}
    if override is not None:
        env["ROUTED_EXPERTS"] = override
    (command,) = _dry_run(**env)
    assert ("--enable-return-routed-experts" in command) is expected


def test_r3_alone_asks_for_routed_experts(tmp_path):
    config = tmp_path / "r3.yaml"
    config.write_text("algorithm:\n  routing_replay: r3\ndrift:\n  enabled: false\n")
    (command,) = _dry_run(CONFIG=str(config))
    assert "--enable-return-routed-experts" in command


@pytest.mark.parametrize(
    ("quantization", "override", "expected"),
    [("fp8", None, True), (None, None, False), ("fp8", "none", False)],
)
def test_fp8_rollouts_launch_with_quantization_fp8(tmp_path, quantization, override, expected):
    config = tmp_path / "run.yaml"
    config.write_text(f"rollout:\n  quantization: {quantization}\n" if quantization else "rollout: {}\n")
    model = tmp_path / "Qwen3-30B-A3B-FP8"  # block FP8, served at TP 4 EP 4: the fp8 check passes
    model.mkdir()
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    hf_config = {"moe_intermediate_size": 768, "quantization_config": quant}
    (model / "config.json").write_text(json.dumps(hf_config))
    env = {"CONFIG": str(config), "MODEL": str(model), "TP": "4", "EP": "4"}
    env |= {"QUANTIZATION": override} if override else {}
    (command,) = _dry_run(**env)
    assert ("--quantization fp8" in command) is expected
