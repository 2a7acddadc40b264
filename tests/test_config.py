from pathlib import Path

import pytest

from megatron_gspo.config import ConfigError, RunConfig, build_model_config, load_config, validate

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "tiny_moe_cpu.yaml"
GRPO = REPO / "configs" / "tiny_moe_cpu_grpo.yaml"


def check(overrides, world_size=1, path=DEMO):
    validate(load_config(path, overrides), world_size=world_size)


def test_demo_configs_load_and_validate():
    for path in (DEMO, GRPO):
        cfg = load_config(path)
        validate(cfg)
        assert isinstance(cfg, RunConfig)
        assert build_model_config(cfg).vocab_size == 80
    assert load_config(GRPO).algorithm.loss_type == "grpo"


def test_dotlist_overrides_are_typed():
    cfg = load_config(DEMO, ["trainer.steps=3", "algorithm.loss_type=grpo", "optim.lr=1e-3", "sft.steps=0"])
    assert cfg.trainer.steps == 3 and cfg.algorithm.loss_type == "grpo"
    assert cfg.optim.lr == pytest.approx(1e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.sft.steps == 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.stepz=3"], "config key 'stepz' in section 'trainer'"),
        (["nonsense.key=1"], "config key 'nonsense' (top level"),
        (["trainer.steps=three"], "config key 'steps' in section 'trainer'"),
        (["rollout.on_invalid=ignore"], "config key 'on_invalid' in section 'rollout'"),
        (["trainer.steps"], "overrides must look like section.key=value"),
        (["optim.lr=-1"], "lr > 0"),
        (["parallel.token_dispatcher=flex"], "config key 'token_dispatcher' in section 'parallel'"),
        (["rollout.dtype=fp16"], "config key 'dtype' in section 'rollout'"),
    ],
)
def test_load_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, overrides)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["parallel.tensor_parallel=2"], 1, "impossible layout for 1 process(es)"),
        (["parallel.expert_parallel=2"], 3, "impossible layout for 3 process(es)"),
        (["parallel.expert_parallel=3"], 3, "does not divide the 8 experts"),
        (["algorithm.loss_agg_mode=seq-mean-token-sum"], 1, "token-sum aggregation weights each response"),
        (
            ["algorithm.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.loss_type=gspo_token"],
            1,
            "token-sum",
        ),
        (["algorithm.loss_agg_mode=mean"], 1, "valid: token-mean"),
        (["rollout.group_size=1"], 1, "at least 2 responses per prompt"),
        (["rollout.rollout_batch_size=3", "rollout.group_size=2"], 1, "do not split into"),
        (["algorithm.num_mini_batches=4"], 5, "do not split into"),
        (["algorithm.loss_type=ppo"], 1, "supported: grpo, gspo, gspo_token, sapo"),
        (["algorithm.loss_type=sapo"], 1, "do not apply to loss 'sapo'"),
        (["algorithm.routing_replay=r3", "engine.fused_kernels=true", "engine.use_te=false"], 1, None),
        (["algorithm.routing_replay=r2", "engine.router_fusion=true"], 1, "silently bypasses"),
        (["rollout.temperature=0"], 1, "temperature > 0"),
        (
            ["rollout.dtype=bf16", "rollout.server_urls=[http://10.0.0.5:30000]"],
            1,
            "rollout.dtype=bf16 sets the embedded server's dtype",
        ),
        (["rollout.max_new_tokens=600"], 1, "exceeds the model's max_position_embeddings=512"),
        (["task.name=chess"], 1, "available: addition"),
        (["task.options.max_digitz=3"], 1, "does not take option(s) ['max_digitz']"),
        (["model.overrides.hidden=3"], 1, "model.overrides has unknown field(s) ['hidden']"),
        (["model.preset=gpt5"], 1, "unknown model preset 'gpt5'"),
        (["model.hf_path=/nonexistent"], 1, "model.overrides only apply to a preset"),
        (["sft.batch_size=63", "parallel.expert_parallel=2"], 2, "sft.batch_size=63"),
        (["algorithm.use_kl_loss=true"], 1, "reference model"),
        (["algorithm.aux_loss_coeff=-0.001"], 1, "aux_loss_coeff must be >= 0"),
        (
            ["parallel.tensor_parallel=2", "engine.use_te=true", "engine.fused_kernels=true"],
            2,
            "expert tensor parallel 2 (parallel.expert_tensor_parallel, default tensor_parallel) with",
        ),
    ],
)
def test_validation_errors(overrides, world, message):
    try:
        cfg = load_config(DEMO, overrides)
    except ConfigError as err:  # some are caught by a component's own check while loading
        assert message is None or message in str(err)
        return
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=world)
    if message is not None:
        assert message in str(err.value)


def test_bf16_on_both_sides_validates_on_cpu():
    cfg = load_config(DEMO, ["engine.dtype=bf16", "rollout.dtype=bf16"])
    validate(cfg)
    cfg.engine.check_hardware()  # bf16 needs no GPU: megatron's mixed precision runs on CPU
    assert (cfg.engine.dtype, cfg.rollout.dtype) == ("bf16", "bf16")


def test_valid_parallel_layout_for_two_ranks():
    check(["parallel.expert_parallel=2"], world_size=2)
    check(["parallel.tensor_parallel=2"], world_size=2)
    gpu = ["parallel.tensor_parallel=2", "engine.use_te=true", "engine.fused_kernels=true"]
    check([*gpu, "parallel.expert_tensor_parallel=1"], world_size=2)  # grouped GEMM with expert TP 1
    check([*gpu[:2], "engine.fused_kernels=false"], world_size=2)  # expert TP 2 without grouped GEMM


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent.yaml")
