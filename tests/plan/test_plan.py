"""`megatron-gspo plan` and the H100 launch scripts, dry-run on CPU: the large configs validate and fit."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_in_process import run_cli_in_process

from megatron_gspo.cli import main as cli
from megatron_gspo.config.schema import WeightSyncConfig
from megatron_gspo.model import config as presets
from megatron_gspo.model.distributed import ParallelConfig
from megatron_gspo.model.engine import EngineConfig
from megatron_gspo.plan import (
    activation_plan,
    micro_batch_shape,
    pipeline_stages,
    shard_plan,
    sync_bytes,
    sync_sender_bytes,
)
from megatron_gspo.plan.checkpoint_memory import save_host_memory

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def math_data(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text('{"problem": "What is $1+1$?", "answer": "2"}\n')
    return path


def plan(*args) -> subprocess.CompletedProcess:
    """`megatron-gspo plan ARGS` in this process (the launch scripts' dry runs below start it as a
    user does)."""
    return run_cli_in_process("plan", *args)


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


def test_save_host_memory_by_hand():
    """TP2 x EP4 on 8 ranks, bf16: 18,112 dense params per rank (4 DP replicas), 12,288 expert (1)."""
    model = presets.tiny(vocab_size=80)
    engine = EngineConfig(dtype="bf16")
    distopt = ParallelConfig(tensor_parallel=2, expert_parallel=4, distributed_optimizer=True)
    states = shard_plan(model, distopt, engine, world_size=8)
    assert (states.dense_params, states.expert_params) == (18112, 12288)
    host = save_host_memory(states, distopt, engine, world_size=8)
    # Routine: this rank writes 18112 / 4 + 12288 = 16816 parameters' bf16 weights (2 B) and
    # its own fp32 main-param + two-moment slice (12 B).
    assert host.routine_bytes == 16816 * (2 + 12) == 235424
    # Reshardable: the same weights, plus the whole TP/EP shard's fp32 state gathered (30400 x 12 B).
    assert host.reshardable_bytes == 16816 * 2 + 30400 * 12 == 398432
    # Plain Adam: model-space state (two moments + fp32 master = 12 B), spread over DP both ways.
    plain = ParallelConfig(tensor_parallel=2, expert_parallel=4)
    host = save_host_memory(shard_plan(model, plain, engine, world_size=8), plain, engine, world_size=8)
    assert host.routine_bytes == host.reshardable_bytes == 16816 * (2 + 12)


FULL_RECOMPUTE = ("engine.recompute_granularity=full", "engine.recompute_modules=null")


@pytest.mark.parametrize(
    "config,world,max_gib,overrides",
    [
        ("qwen3_30b_a3b_gspo", 16, 50, ()),
        ("qwen3_30b_a3b_grpo_r2", 16, 50, ()),
        ("qwen3_235b_a22b_gspo", 128, 50, ()),
        ("qwen3_235b_a22b_gspo", 64, 70, FULL_RECOMPUTE),  # half the GPUs: only with full recompute
    ],
)
def test_large_configs_validate_and_fit_on_h100(config, world, max_gib, overrides, math_data):
    result = plan(
        "--config", f"configs/{config}.yaml", "--world-size", str(world), f"task.options.path={math_data}",
        *overrides,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fits" in result.stdout
    states = float(result.stdout.split(" GiB model states")[0].rsplit("= ", 1)[1])
    assert 10 < states < max_gib
    activation = next(line for line in result.stdout.splitlines() if line.startswith("activation: "))
    assert "tokens (trainer.max_tokens_per_micro_batch); logits" in activation  # packed by a token budget
    assert ("with recompute full" if overrides else "with recompute selective: ") in activation
    assert "communication overlap: gradient reduction (under the backward) and parameter all-gather" in (
        result.stdout
    )
    per_gpu = next(line for line in result.stdout.splitlines() if line.startswith("per GPU: "))
    assert per_gpu.endswith("GiB of 79.1 GiB") and " activation + 6 reserve" in per_gpu  # an H100's usable
    host = next(line for line in result.stdout.splitlines() if line.startswith("checkpoint save, host"))
    routine, reshardable = (
        float(part.split(" GiB per rank")[0].rsplit(" ", 1)[1]) for part in host.split(";")
    )
    assert 0 < routine < reshardable and "GiB per node of 8" in host


def test_pipeline_stages_split_layers_and_model_ends_by_hand():
    """4 layers over PP2: each stage half the layers and experts; embedding first, output + norm last."""
    h, vocab = 64, 80
    parallel = ParallelConfig(
        tensor_parallel=2, pipeline_parallel=2, expert_parallel=2, distributed_optimizer=True
    )
    engine = EngineConfig(dtype="bf16")
    for tied in (False, True):
        model = presets.tiny(vocab_size=vocab, num_layers=4, tie_word_embeddings=tied)
        expert_layer = 8 * 3 * h * 32
        dense_layer = (model.num_parameters - vocab * h * (1 if tied else 2) - h) // 4 - expert_layer
        first, last = pipeline_stages(4, ParallelConfig(pipeline_parallel=2))
        assert (first.first_layer, first.layers, first.embedding, first.output) == (0, 2, True, False)
        assert (last.first_layer, last.layers, last.embedding, last.output) == (2, 2, False, True)
        plans = [shard_plan(model, parallel, engine, world_size=8, stage=s) for s in (first, last)]
        assert [p.expert_params for p in plans] == [
            2 * expert_layer // 4
        ] * 2  # 2 layers over EP2 x expert TP2
        # A tied output layer is still a full copy of the embedding on the last stage.
        assert plans[0].dense_params == (2 * dense_layer + vocab * h) // 2
        assert plans[1].dense_params == (2 * dense_layer + vocab * h + h) // 2
        # Dense optimizer states shard over 8 / (TP2 x PP2) = 2 replicas, experts over 8 / (2 x 2 x 2) = 1.
        assert plans[0].optimizer_bytes == int(plans[0].dense_params * 12 / 2 + plans[0].expert_params * 12)
        whole = shard_plan(model, ParallelConfig(tensor_parallel=2, expert_parallel=2), engine, world_size=4)
        assert whole.expert_params == 2 * plans[0].expert_params
    with pytest.raises(ValueError, match="does not divide the 94 transformer layers"):
        pipeline_stages(94, ParallelConfig(pipeline_parallel=4))


def test_pipeline_activations_follow_the_1f1b_schedule():
    """Stage s of PP holds PP - s micro-batches of its layers' activations; only the last has logits."""
    model = presets.tiny(vocab_size=80, num_layers=4)
    pp2 = ParallelConfig(tensor_parallel=2, pipeline_parallel=2, expert_parallel=1, expert_tensor_parallel=1)
    pp1 = ParallelConfig(tensor_parallel=2, expert_parallel=1, expert_tensor_parallel=1)
    kwargs = dict(tokens=100, seq_len=50, flash_attention=True)
    for engine in (EngineConfig(dtype="bf16"), EngineConfig(dtype="bf16", recompute_activations=True)):
        whole = activation_plan(model, pp1, engine, **kwargs)
        first, last = (
            activation_plan(model, pp2, engine, stage=s, **kwargs) for s in pipeline_stages(4, pp2)
        )
        assert (first.in_flight, last.in_flight) == (2, 1)
        assert first.logits_bytes == 0 and last.logits_bytes == whole.logits_bytes == 100 * 40 * 10
        rebuilt = whole.layer_bytes if engine.recompute_activations else 0  # one layer recomputed
        per_layer = (whole.stored_bytes - rebuilt) // 4  # what one layer keeps for one micro-batch
        assert first.stored_bytes == 2 * 2 * per_layer + rebuilt  # 2 layers x 2 micro-batches
        assert last.stored_bytes == 1 * 2 * per_layer + rebuilt


def test_activation_plan_counts_by_hand():
    """Tiny model, TP2 (SP), expert TP 1, bf16, 100 tokens: each term counted from the data path."""
    model = presets.tiny(vocab_size=80)  # H=64, 4 heads / 2 groups of 16, 8 experts top-2, F=32
    parallel = ParallelConfig(tensor_parallel=2, expert_parallel=1, expert_tensor_parallel=1)
    engine = EngineConfig(dtype="bf16")
    plain = activation_plan(model, parallel, engine, tokens=100, seq_len=50, flash_attention=True)
    # logits: 100 tokens x 40 (vocab / TP) x 2 bytes bf16, and two fp32 chunks, here of every token
    assert plain.logits_bytes == 100 * 40 * (2 + 2 * 4)
    attention = 2 * 64 + (4 + 2 * 2) * 16 + (4 + 2) * 16 + 4 * 16  # norm inputs, qkv, qk-norm in, core out
    moe = 3 * 64 + 2 * (2 * 64 + 3 * 32)  # norm/router in + output; per routed token: in, fc1, swiglu, fc2
    router = 2 * 8 * 4  # fp32 logits + probs over 8 experts
    per_token = (attention + moe) * 2 // 2 + router // 2  # bf16, all sharded over TP 2
    assert plain.layer_bytes == 100 * per_token and plain.stored_bytes == 2 * plain.layer_bytes
    recompute = activation_plan(
        model, parallel, EngineConfig(dtype="bf16", recompute_activations=True),
        tokens=100, seq_len=50, flash_attention=True,
    )  # fmt: skip
    assert recompute.stored_bytes == 2 * 100 * (64 // 2) * 2 + plain.layer_bytes  # 2 layer inputs + 1 layer
    local = activation_plan(model, parallel, engine, tokens=100, seq_len=50, flash_attention=False)
    assert local.layer_bytes - plain.layer_bytes == 100 * 2 * 4 // 2 * 50 * 2  # scores + probs [heads/TP, L]


def test_selective_recompute_activations_by_hand():
    """Each module discards what it rebuilds (same model and layout as the test above)."""
    model = presets.tiny(vocab_size=80)
    parallel = ParallelConfig(tensor_parallel=2, expert_parallel=1, expert_tensor_parallel=1)
    shape = dict(tokens=100, seq_len=50)

    def selective(*modules, flash=True):
        engine = EngineConfig(
            dtype="bf16", recompute_granularity="selective", recompute_modules=list(modules)
        )
        return activation_plan(model, parallel, engine, **shape, flash_attention=flash)

    attention = 2 * 64 + (4 + 2 * 2) * 16 + (4 + 2) * 16 + 4 * 16
    moe = 3 * 64 + 2 * (2 * 64 + 3 * 32)
    router = 2 * 8 * 4
    # moe_act: the SwiGLU output of each of the 2 routed copies (F = 32); layernorm: the router's input (H)
    act = selective("moe_act", "layernorm")
    assert act.recompute == "selective: moe_act, layernorm"
    assert act.layer_bytes == 100 * ((attention + moe - 2 * 32 - 64) * 2 // 2 + router // 2)
    assert act.stored_bytes == 2 * act.layer_bytes
    # core_attn: the local attention's scores and softmax; flash attention keeps none to discard
    assert selective("core_attn", flash=False).layer_bytes == selective("core_attn").layer_bytes
    # moe: the block keeps only its input; one block rebuilt at a time
    block = selective("moe")
    assert block.layer_bytes == 100 * (attention + 64) * 2 // 2
    whole = 100 * ((attention + moe) * 2 // 2 + router // 2)
    assert block.stored_bytes == 2 * block.layer_bytes + (whole - block.layer_bytes)


def test_weight_sync_sender_buffers_by_hand():
    """Rank 0 holds two buckets and one gathered global tensor, at most the embedding."""
    tiny = presets.tiny(vocab_size=79)  # padded to 80 for TP2
    bf16, tp2 = EngineConfig(dtype="bf16"), ParallelConfig(tensor_parallel=2)
    assert sync_sender_bytes(tiny, tp2, bf16, WeightSyncConfig(bucket_mb=1.0)) == 2 * 2**20 + 80 * 64 * 2
    # Qwen3-30B-A3B, 1 GiB buckets, bf16: 2 GiB + the 151,936 x 2,048 embedding (0.58 GiB) = 2.58 GiB
    big = sync_sender_bytes(
        presets.qwen3_30b_a3b(), ParallelConfig(tensor_parallel=4), bf16, WeightSyncConfig()
    )
    assert big == 2 * 2**30 + 151936 * 2048 * 2 == 2_769_813_504


def test_rank0_weight_sync_buffers_can_decide_the_fit(math_data):
    """16 GiB buckets: rank 0's sync (43.7 + 2 x 16 + 0.58 GiB) outgrows its training peak (69.4 GiB)."""
    config = "configs/qwen3_30b_a3b_gspo.yaml"
    result = plan(
        "--config",
        config,
        "--world-size",
        "16",
        f"task.options.path={math_data}",
        "weight_sync.bucket_mb=16384",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "weight sync, rank 0: 32.6 GiB of buffers" in result.stdout
    assert "= 69.4 GiB; rank 0's weight sync + reserve 82.3 GiB of 79.1 GiB" in result.stdout
    assert "DOES NOT FIT: 3.2 GiB over" in result.stdout


def test_plan_refuses_what_exceeds_the_gpu_and_says_by_how_much(math_data):
    base = [
        "--config",
        "configs/qwen3_30b_a3b_gspo.yaml",
        "--world-size",
        "16",
        f"task.options.path={math_data}",
    ]
    fits = plan(*base)
    no_recompute = plan(
        *base,
        "engine.recompute_granularity=null",
        "engine.recompute_modules=null",
        "trainer.max_tokens_per_micro_batch=36864",
    )
    assert fits.returncode == 0 and no_recompute.returncode == 1, no_recompute.stdout + no_recompute.stderr

    def gib(result, before, after):
        return float(result.stdout.split(before)[1].split(after)[0])

    need = gib(no_recompute, "reserve = ", " GiB of 79.1")
    assert f"DOES NOT FIT: {need - 79.1:.1f} GiB over the 79.1 GiB GPU" in no_recompute.stdout
    assert gib(no_recompute, "recompute off (recompute off: ", " GiB") > 50  # 48 layers of activations
    smaller_gpu = plan(*base, "--gpu-memory-gb", "40")
    assert smaller_gpu.returncode == 1 and "GiB over the 40 GiB GPU" in smaller_gpu.stdout


def test_plan_accepts_timeout_and_data_set_field_names(tmp_path):
    data = tmp_path / "gsm.jsonl"
    data.write_text('{"question": "What is $1+1$?", "solution": "2"}\n')
    result = plan(
        "--config", "configs/qwen3_30b_a3b_gspo.yaml", "--world-size", "16", f"task.options.path={data}",
        "parallel.timeout_minutes=240",
        "task.options.prompt_key=question", "task.options.answer_key=solution",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "activation: " in result.stdout


def test_plan_refuses_a_layout_that_does_not_fit(math_data):
    result = plan(
        "--config",
        "configs/qwen3_235b_a22b_gspo.yaml",
        "--world-size",
        "128",
        f"task.options.path={math_data}",
        "parallel.expert_parallel=8",
        "parallel.distributed_optimizer=false",
        "parallel.overlap_param_gather=false",  # it needs the distributed optimizer
    )
    assert result.returncode == 1 and "DOES NOT FIT" in result.stdout, result.stdout + result.stderr


def test_235b_uneven_stages_fit_128_gpus_with_headroom(math_data):
    """slime's layout: TP4 PP4 EP16, stages of 24 + 24 + 24 + 22 layers, each planned on its own."""

    def plan_235b(world, *overrides):
        config = "configs/qwen3_235b_a22b_gspo.yaml"
        return plan("--config", config, "--world-size", world, f"task.options.path={math_data}", *overrides)

    result = plan_235b("128")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "on 128 ranks: TP=4 PP=4 EP=16 ETP=1 DP=8" in out
    stages = re.findall(r"^stage (\d): layers (\d+)-(\d+)(.*?): model states ([\d.]+) GiB", out, re.M)
    assert [(int(a), int(b)) for _, a, b, _, _ in stages] == [(0, 23), (24, 47), (48, 71), (72, 93)]
    assert stages[0][3] == " + embedding" and stages[3][3] == " + output layer"
    # 22 layers on the last stage: fewer expert states than a 24-layer stage beside it
    assert float(stages[3][4]) < float(stages[2][4])
    assert "(4 micro-batch(es) in flight)" in out and "per rank: stage 0 (the largest)" in out
    spare = float(re.search(r"fits \(([\d.]+) GiB to spare\)", out).group(1))
    assert spare > 10, out  # selective recompute of the MoE blocks (full: 26 GiB spare)
    flat = plan_235b(
        "64", "parallel.pipeline_parallel=1", "parallel.expert_parallel=64", "parallel.last_stage_layers=null"
    )
    assert flat.returncode == 1 and "DOES NOT FIT" in flat.stdout, flat.stdout + flat.stderr
    even = plan_235b("128", "parallel.last_stage_layers=null")
    assert even.returncode == 2
    assert "parallel.pipeline_parallel=4 does not divide the 94 transformer layers" in even.stderr
    bridge = plan_235b(
        "128",
        "parallel.pipeline_parallel=16",
        "parallel.expert_parallel=8",
        "parallel.last_stage_layers=null",
        "parallel.account_for_embedding_in_pipeline_split=true",
        "parallel.account_for_loss_in_pipeline_split=true",
    )
    assert bridge.returncode == 0, bridge.stdout + bridge.stderr
    assert "stage 0: layers 0-4 + embedding" in bridge.stdout
    assert "stage 15: layers 89-93 + output layer" in bridge.stdout
    too_few = plan_235b("48")
    assert too_few.returncode == 2
    assert "impossible layout for 48 process(es)" in too_few.stderr and "pipeline_parallel" in too_few.stderr


def test_plan_names_an_impossible_world_size(math_data):
    result = plan(
        "--config", "configs/qwen3_30b_a3b_gspo.yaml", "--world-size", "12", f"task.options.path={math_data}"
    )
    assert result.returncode == 2
    assert "config error: parallel: impossible layout for 12 process(es)" in result.stderr


@pytest.mark.parametrize(
    "option, value",
    [("--world-size", "-8"), ("--world-size", "0"), ("--gpus-per-node", "0"), ("--gpu-memory-gb", "nan")],
)
def test_plan_refuses_a_size_that_cannot_be(option, value, capsys):
    """Not a plan with negative memory that "fits", nor a ZeroDivisionError: one line naming the option."""
    args = ["plan", "--config", "configs/qwen3_30b_a3b_gspo.yaml", "--world-size", "16", option, value]
    with pytest.raises(SystemExit) as exited:
        cli(args)
    assert exited.value.code == 2
    assert f"argument {option}: must be" in capsys.readouterr().err


def test_train_launcher_dry_run(math_data):
    result = train_dry_run(math_data, "configs/qwen3_30b_a3b_gspo.yaml", NNODES="2")
    assert re.search(
        r"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (GLOO_SOCKET_IFNAME=\S+ )?"
        r"torchrun --nnodes 2 --node_rank 0",
        result.stdout,
    )
    assert "rollout.server_urls=[http://a:1,http://b:2]" in result.stdout
    assert "on 16 ranks" in result.stdout and "fits" in result.stdout


def test_the_colocated_dry_run_says_ipc_buckets_leave_expandable_segments(math_data):
    # The launcher keeps expandable segments for the step; the tensor handles' buckets are made
    # outside them (CUDA IPC of an expandable segment needs pidfd_getfd rights SGLang may lack).
    result = train_dry_run(math_data, "configs/qwen3_30b_a3b_gspo_colocated.yaml", NNODES="1")
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --nnodes 1" in result.stdout
    assert "each bucket is allocated with expandable segments off" in result.stdout
    assert "weight_sync/ipc_allocation.py" in result.stdout
    assert "GLOO_SOCKET_IFNAME" not in result.stdout  # one node: gloo stays on this host


def test_a_multi_node_launch_sets_gloo_on_the_interface_that_reaches_the_master(math_data):
    # gloo binds what this host's name resolves to: 127.0.1.1 or a docker bridge on some hosts.
    config = "configs/qwen3_30b_a3b_gspo.yaml"
    kept = train_dry_run(math_data, config, NNODES="2", GLOO_SOCKET_IFNAME="ib0")
    assert "GLOO_SOCKET_IFNAME=ib0 torchrun --nnodes 2" in kept.stdout  # the operator's choice stands
    routed = subprocess.run(["ip", "-o", "route", "show", "default"], capture_output=True, text=True)
    if shutil.which("ip") is None or not routed.stdout.strip():
        pytest.skip("no `ip` or no default route here: nothing to derive the interface from")
    derived = train_dry_run(math_data, config, NNODES="2", MASTER_ADDR="localhost")
    name = re.search(r"GLOO_SOCKET_IFNAME=(\S+) torchrun", derived.stdout)
    assert name and name[1] != "lo" and Path("/sys/class/net", name[1]).exists(), derived.stdout[:300]


def train_dry_run(math_data, config: str, **extra) -> subprocess.CompletedProcess:
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "GLOO_SOCKET_IFNAME")},
        "DRY_RUN": "1",
        "DATA": str(math_data),
        "SGLANG_URLS": "http://a:1,http://b:2",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        **extra,
    }
    result = subprocess.run(
        ["bash", "launch/train_h100.sh", config],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def sglang_dry_run(**extra):
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "MODEL": "/ckpt/Qwen3-30B-A3B",
        "TP": "4",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        **extra,
    }
    result = subprocess.run(
        ["bash", "launch/sglang_servers.sh"], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_sglang_launcher_dry_run():
    out = sglang_dry_run()
    assert "--enable-return-routed-experts" in out and "--tp-size 4" in out
    assert "--enable-deterministic-inference" not in out


def test_sglang_launcher_follows_the_configs_reproducible_seeds(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text((ROOT / "configs/qwen3_30b_a3b_gspo.yaml").read_text())
    assert "--enable-deterministic-inference" not in sglang_dry_run(CONFIG=str(config))
    text = config.read_text().replace("deterministic_inference: false", "deterministic_inference: true")
    config.write_text(text)
    assert "--enable-deterministic-inference" in sglang_dry_run(CONFIG=str(config))
    assert "--enable-deterministic-inference" not in sglang_dry_run(CONFIG=str(config), DETERMINISTIC="0")
    assert "--enable-deterministic-inference" in sglang_dry_run(DETERMINISTIC="1")


def test_gpu_engine_settings_load_on_cpu_but_refuse_to_build():
    engine = EngineConfig(dtype="bf16", use_te=True, fused_kernels=True)
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ValueError, match="use_te=true needs CUDA"):
            engine.check_hardware()


def test_plan_sizes_the_activation_by_the_token_budget(math_data):
    base = [
        "--config",
        "configs/qwen3_30b_a3b_gspo.yaml",
        "--world-size",
        "16",
        f"task.options.path={math_data}",
        *FULL_RECOMPUTE,  # so that 36864 tokens fit
    ]
    # 4 responses x (1024 + 8192) = 36864 tokens per micro-batch
    by_count = plan(*base, "trainer.max_tokens_per_micro_batch=0", "trainer.micro_batch_size=4")
    budget = base  # the config's own budget (12288) is replaced below
    small = plan(*budget, "trainer.max_tokens_per_micro_batch=9216")
    large = plan(*budget, "trainer.max_tokens_per_micro_batch=18432")
    assert small.returncode == large.returncode == 0, small.stdout + small.stderr

    def activation(result):
        line = next(line for line in result.stdout.splitlines() if line.startswith("activation: "))
        return line, float(line.rsplit("= ", 1)[1].split(" GiB")[0])

    line, small_gib = activation(small)
    assert "micro-batch of up to 9216 tokens (trainer.max_tokens_per_micro_batch)" in line
    assert "micro-batch 4 x 9216 = 36864 tokens" in activation(by_count)[0]
    # Activations grow with the tokens: twice the budget, about twice the memory; the count-based
    # 36864 tokens about four times.
    assert activation(large)[1] == pytest.approx(2 * small_gib, rel=0.1)
    assert activation(by_count)[1] == pytest.approx(4 * small_gib, rel=0.1)
    too_small = plan(*budget, "trainer.max_tokens_per_micro_batch=9000")
    assert too_small.returncode != 0
    assert (
        "trainer.max_tokens_per_micro_batch=9000 is below the longest possible row: prompt (1024) + "
        "rollout.max_new_tokens (8192) = 9216 tokens" in too_small.stdout + too_small.stderr
    )


def test_plan_counts_the_reference_model_with_and_without_offload(math_data):
    def run(offload):
        result = plan(
            "--config", "configs/qwen3_30b_a3b_gspo_roll.yaml", "--world-size", "16",
            f"task.options.path={math_data}", f"model.ref_offload={str(offload).lower()}",
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        lines = result.stdout.splitlines()
        states = float(result.stdout.split(" GiB model states")[0].rsplit("= ", 1)[1])
        return states, next(line for line in lines if line.startswith("reference model (KL loss): "))

    resident, line = run(False)
    offloaded, offload_line = run(True)
    # 30B-A3B at TP4 / EP8: 385M dense + 3624M expert parameters per rank, bf16: 7.5 GiB of weights.
    weights = float(line.split("bf16 weights ")[1].split(" GiB")[0])
    assert weights == pytest.approx(7.5, abs=0.05)
    assert resident - offloaded == pytest.approx(weights, abs=0.11)  # printed to 0.1 GiB
    assert "on the GPU" in line and "pinned host memory" in offload_line


def test_sync_bytes_fp8_is_about_half_of_bf16_and_unquantised_is_every_parameter(math_data):
    for model in (
        presets.qwen3_30b_a3b(),
        presets.tiny(vocab_size=80),
        presets.tiny(tie_word_embeddings=True),
    ):
        assert sync_bytes(model, 2) == model.num_parameters * 2
    model = presets.qwen3_30b_a3b()
    ratio = sync_bytes(model, 2, "fp8") / sync_bytes(model, 2)
    assert 0.5 < ratio < 0.52  # FP8 projections; embeddings, lm_head, norms, routers stay bf16
    result = plan(
        "--config",
        "configs/qwen3_30b_a3b_gspo.yaml",
        "--world-size",
        "16",
        f"task.options.path={math_data}",
        "rollout.quantization=fp8",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("weight sync: "))
    assert f"fp8: {ratio:.2f}x the 56.9 GiB in bf16)" in line, line


def test_context_parallel_activations_are_those_of_tokens_over_cp():
    """CP2 on 100 tokens holds what 50 tokens cost without CP: layers and logits alike."""
    model = presets.tiny(vocab_size=80)
    engine = EngineConfig(dtype="bf16")
    cp2 = activation_plan(
        model, ParallelConfig(context_parallel=2), engine, tokens=100, seq_len=100, flash_attention=True
    )
    half = activation_plan(model, ParallelConfig(), engine, tokens=50, seq_len=100, flash_attention=True)
    assert cp2.tokens == 50 and cp2.logits_bytes == 50 * 80 * (2 + 2 * 4)
    assert (cp2.layer_bytes, cp2.stored_bytes, cp2.logits_bytes) == (
        half.layer_bytes,
        half.stored_bytes,
        half.logits_bytes,
    )


@pytest.mark.parametrize("bos", [True, False], ids=["tokenizer_with_bos", "tokenizer_without_bos"])
def test_plan_counts_a_bos_only_when_the_tokenizer_has_one(tmp_path, bos):
    """`task.add_bos` unset: the run adds the tokenizer's BOS, none for Qwen's; plan counted one always."""
    from transformers import AutoTokenizer

    from megatron_gspo.config import build_task, load_config, prompts_start_with_bos
    from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint

    checkpoint = make_tiny_hf_checkpoint(tmp_path / "hf", presets.tiny(vocab_size=80))
    if not bos:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        tokenizer.bos_token = None
        tokenizer.save_pretrained(checkpoint)
    cfg = load_config(
        ROOT / "configs" / "tiny_moe_cpu.yaml", ["model.overrides={}", f"model.hf_path={checkpoint}"]
    )
    assert cfg.task.add_bos is None and prompts_start_with_bos(cfg) is bos
    task = build_task(cfg)
    _, seq_len, _ = micro_batch_shape(cfg, task, 1)
    assert seq_len == task.max_prompt_len + int(bos) + cfg.rollout.max_new_tokens


def test_colocated_30b_on_one_node_reports_each_phase_and_refuses_what_does_not_fit(math_data):
    """By hand: EP 8 leaves 1541M dense + 3624M expert params per rank (~5.2B); the expert Adam
    state, unsharded (expert DP 1), is 3624M x 12 bytes = 40.5 GiB; SGLang's bf16 weights over TP 4
    are 30.5B x 2 / 4 = 14.2 GiB per GPU. Every phase carries SGLang's remainder 2, the trainer's
    remainder 2 (what each keeps reserved with its state freed) and the reserve 6: 10 GiB."""
    args = ["--config", "configs/qwen3_30b_a3b_gspo_colocated.yaml", f"task.options.path={math_data}"]
    result = plan(*args, "--world-size", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "per rank: 1541M dense + 3624M expert params" in out
    assert "SGLang weights 14.2 GiB + KV cache 16 GiB per GPU" in out
    assert "optimizer 42.7 GiB x 1 stepped on the host" in out  # 40.5 expert + 2.2 dense
    # Parked in pinned host memory: the bf16 weight buffers, 1541M x 2 = 2.9 GiB -> a 4 GiB block and
    # 3624M x 2 = 6.8 GiB -> 8 GiB (the pinned allocator's powers of two); gradients dropped.
    assert "parked in pinned host memory during generation: 12.0 GiB per rank" in out
    both = "(SGLang's remainder 2, the trainer's 2 and the reserve 6 included)"
    # Start-up: the servers' static pool (weights 14.2 + KV cache 16) is held while the trainer's
    # states 28.9 (bf16 weights 9.6 + fp32 grads 19.2 + the 0.0 optimizer share on the GPU) are on
    # the GPU for the start-up sync (buffers 2.6; no SFT here) + 10.
    assert f"phase start-up: peak 71.7 GiB per GPU {both}" in out
    # Generation: SGLang's pool 30.2 beside what the trainer keeps reserved (its remainder): + 10.
    assert f"phase generation: peak 40.2 GiB per GPU {both}" in out
    # Training: the states 28.9 + one micro-batch's activations 6.2 (logits 3.3 + full-recompute
    # layer inputs 3.0) + 10: without the activations this would read 38.9.
    assert f"phase training: peak 45.1 GiB per GPU {both}" in out
    # The sync reads the trainer's bf16 weights 9.6 on the device (gradients and optimizer parked)
    # beside SGLang's resumed 14.2, plus the 2.6 of sync buffers + 10.
    assert f"phase weight sync: peak 36.4 GiB per GPU {both}" in out
    # The save: trainer states 28.9 beside SGLang's weights 14.2 + 10.
    assert f"phase checkpoint save: peak 53.1 GiB per GPU {both}" in out
    assert "colocated fits: the start-up phase decides (7.4 GiB to spare)" in out  # of 79.1
    # SGLang's static pool: (14.2 weights + 16 KV cache) / 79.1 GiB = 0.38 of the GPU
    assert "SGLang: --mem-fraction-static 0.38 holds these weights and a 16 GiB KV cache" in out
    on_h200 = plan(*args, "--world-size", "8", "--gpu-memory-gb", "139")
    assert on_h200.returncode == 0 and "the start-up phase decides (67.3 GiB to spare)" in on_h200.stdout
    no_offload = ["optim.optimizer_cpu_offload=false", "optim.overlap_cpu_optimizer_d2h_h2d=false"]
    refused = plan(*args, "--world-size", "8", *no_offload)
    assert refused.returncode == 1
    assert "DOES NOT FIT (colocated, start-up phase)" in refused.stdout
    assert f"phase checkpoint save: peak 95.7 GiB per GPU {both}" in refused.stdout  # refused by it too
    # Selective recompute keeps every layer's activations but attention's (62.4 + logits 3.3 = 65.7
    # GiB): the training phase, 28.9 + 65.7 + 10 = 104.6 GiB, is what refuses it.
    selective = plan(*args, "--world-size", "8", "engine.recompute_granularity=selective")
    assert selective.returncode == 1
    assert f"phase training: peak 104.6 GiB per GPU {both}" in selective.stdout
    assert "DOES NOT FIT (colocated, training phase): 104.6 GiB is 25.5 GiB over" in selective.stdout
