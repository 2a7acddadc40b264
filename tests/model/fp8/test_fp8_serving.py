"""FP8 rollouts on real SGLang are refused by name, before a server or a rank starts, unless they can work.

SGLang 0.5.23 serves a checkpoint without a block quantization_config with online per-tensor FP8
(no weight_scale_inv: the trainer's block scales are dropped), and refuses to start a block-FP8
MoE whose per-rank expert width moe_intermediate_size / (TP / EP) is not a multiple of 128
(`megatron_gspo/model/fp8/serving.py` cites where).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.config import ConfigError, load_config, validate
from megatron_gspo.model.fp8.blockwise import QUANTIZATION_CONFIG
from megatron_gspo.model.fp8.serving import Fp8ServingError, check_fp8_serving

ROOT = Path(__file__).resolve().parents[3]
QWEN3_30B = ROOT / "configs" / "qwen3_30b_a3b_gspo.yaml"


def checkpoint(tmp_path: Path, width: int = 768, fp8: bool = True, name: str = "ckpt") -> Path:
    """An HF checkpoint directory holding only config.json (Qwen3-30B-A3B's expert width by default)."""
    cfg = {"model_type": "qwen3_moe", "moe_intermediate_size": width, "num_experts": 128}
    if fp8:
        cfg["quantization_config"] = (
            QUANTIZATION_CONFIG  # what the trainer's sync sends: model/fp8/blockwise.py
        )
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("key", ["modules_to_not_convert", "ignored_layers"])
@pytest.mark.parametrize(
    "entry",
    [
        "model.layers.0.self_attn.q_proj",
        "layers.3.mlp.experts.7.down_proj",
        "model.layers.5.mlp",
        "model.layers.2",
    ],
)
def test_a_checkpoint_keeping_a_quantised_projection_unquantised_is_refused(tmp_path, key, entry):
    # SGLang serves such a module in bf16 without weight_scale_inv: raw FP8 cast in, scales dropped.
    path = checkpoint(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {**QUANTIZATION_CONFIG, key: ["lm_head", entry]}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        Fp8ServingError, match=rf"keeps \['{entry}'\] unquantised \(quantization_config.{key}\)"
    ):
        check_fp8_serving(path, 4, 4)


def test_modules_the_trainer_never_quantises_may_stay_unquantised(tmp_path):
    path = checkpoint(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    kept = ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate", "model.layers.1.input_layernorm"]
    cfg["quantization_config"] = {**QUANTIZATION_CONFIG, "modules_to_not_convert": kept}
    (path / "config.json").write_text(json.dumps(cfg))
    check_fp8_serving(path, 4, 4)  # the router gates, norms, embeddings, lm_head stay bf16 anyway


def test_bf16_checkpoint_is_refused(tmp_path):
    with pytest.raises(Fp8ServingError, match="is not block FP8 .* drop the block scales"):
        check_fp8_serving(checkpoint(tmp_path, fp8=False), 4, 4)


@pytest.mark.parametrize(
    ("width", "tp", "ep", "per_rank"),
    [(768, 4, 1, "192"), (1536, 8, 1, "192"), (768, 8, 2, "192")],  # 30B at TP 4, 235B at TP 8
)
def test_expert_width_not_whole_blocks_is_refused(tmp_path, width, tp, ep, per_rank):
    with pytest.raises(Fp8ServingError, match=f"at TP={tp}, EP={ep} .* gives {per_rank};"):
        check_fp8_serving(checkpoint(tmp_path, width), tp, ep)


@pytest.mark.parametrize(("width", "tp", "ep"), [(768, 4, 4), (768, 4, 2), (1536, 8, 8), (768, 1, 1)])
def test_whole_blocks_per_rank_are_accepted(tmp_path, width, tp, ep):
    check_fp8_serving(checkpoint(tmp_path, width), tp, ep)


def test_the_refusal_names_the_layouts_that_work(tmp_path):
    with pytest.raises(Fp8ServingError, match=r"Use EP in \[2, 4\] at TP=4"):
        check_fp8_serving(checkpoint(tmp_path), 4, 1)


SERVERS = ["rollout.quantization=fp8", "rollout.server_urls=[http://127.0.0.1:30000]"]


def _config(path: Path, tmp_path: Path, overrides: list[str]):
    """`path` loaded with `overrides` and a one-problem math file (the H100 configs read /data)."""
    data = tmp_path / "math.jsonl"
    data.write_text('{"problem": "What is $1+1$?", "answer": "2"}\n')
    return load_config(path, [f"task.options.path={data}", *overrides])


def _validate_30b(tmp_path, overrides):
    validate(_config(QWEN3_30B, tmp_path, overrides), world_size=16)


def test_config_refuses_fp8_from_a_bf16_server_checkpoint(tmp_path):
    bf16 = checkpoint(tmp_path, fp8=False)
    with pytest.raises(ConfigError, match="is not block FP8"):
        _validate_30b(tmp_path, [*SERVERS, f"rollout.server_checkpoint={bf16}"])


def test_config_refuses_fp8_at_tp4_ep1_on_30b(tmp_path):
    fp8 = checkpoint(tmp_path)
    layout = ["rollout.server_tensor_parallel=4", "rollout.server_expert_parallel=1"]
    with pytest.raises(ConfigError, match="gives 192;.*rollout.server_expert_parallel=1"):
        _validate_30b(tmp_path, [*SERVERS, f"rollout.server_checkpoint={fp8}", *layout])


def test_config_needs_the_server_checkpoint_for_fp8_on_sglang(tmp_path):
    with pytest.raises(ConfigError, match="needs rollout.server_checkpoint"):
        _validate_30b(tmp_path, SERVERS)


def test_config_accepts_fp8_at_the_documented_layout(tmp_path):
    # configs/qwen3_30b_a3b_gspo.yaml's server layout (TP 4, EP 4): whole experts per rank.
    cfg = _config(QWEN3_30B, tmp_path, [*SERVERS, f"rollout.server_checkpoint={checkpoint(tmp_path)}"])
    assert (cfg.rollout.server_tensor_parallel, cfg.rollout.server_expert_parallel) == (4, 4)
    validate(cfg, world_size=16)
    # The fleet config (servers behind a router) at its own layout; EP 1 there is refused too.
    fleet = ROOT / "configs" / "qwen3_30b_a3b_gspo_fleet.yaml"
    behind_router = [
        "rollout.quantization=fp8",
        "rollout.router_url=http://127.0.0.1:30100",
        f"rollout.server_checkpoint={checkpoint(tmp_path, name='fleet')}",
    ]
    validate(_config(fleet, tmp_path, behind_router), world_size=16)
    with pytest.raises(ConfigError, match="gives 192;"):
        ep1 = [*behind_router, "rollout.server_expert_parallel=1"]
        validate(_config(fleet, tmp_path, ep1), world_size=16)


def test_embedded_server_fp8_needs_no_sglang_checkpoint():
    # The CPU server dequantises what it receives at any width: the tiny FP8 demo stays valid.
    validate(load_config(ROOT / "configs" / "tiny_moe_cpu.yaml", ["rollout.quantization=fp8"]))


def _launch(**env) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # python with yaml
    base = {k: v for k, v in os.environ.items() if k not in ("CONFIG", "QUANTIZATION", "DP", "TP", "EP")}
    env = {**base, "PATH": path, "DRY_RUN": "1", "HOST": "127.0.0.1", "QUANTIZATION": "fp8", **env}
    return subprocess.run(
        ["bash", "launch/sglang_servers.sh"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )


def test_launch_script_refuses_fp8_from_a_bf16_checkpoint(tmp_path):
    result = _launch(MODEL=str(checkpoint(tmp_path, fp8=False)), TP="4", EP="4")
    assert result.returncode == 1 and "would run" not in result.stdout
    assert "is not block FP8" in result.stderr


def test_launch_script_refuses_fp8_at_tp4_ep1(tmp_path):
    result = _launch(MODEL=str(checkpoint(tmp_path)), TP="4", EP="1")
    assert result.returncode == 1 and "would run" not in result.stdout
    assert "at TP=4, EP=1 (expert TP 4 = TP / EP) gives 192" in result.stderr


def test_launch_script_starts_fp8_at_tp4_ep4(tmp_path):
    result = _launch(MODEL=str(checkpoint(tmp_path)), TP="4", EP="4")
    assert result.returncode == 0, result.stderr
    (command,) = [line for line in result.stdout.splitlines() if line.startswith("would run: ")]
    assert "--tp-size 4 --ep-size 4 " in command and "--quantization fp8" in command
