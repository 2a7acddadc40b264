import re
from pathlib import Path

import pytest
import yaml

from megatron_gspo.config import (
    ConfigError,
    RunConfig,
    build_model_config,
    check_rollout_timeouts,
    load_config,
    validate,
)
from megatron_gspo.config.loading import to_yaml

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
        (["=3"], "overrides must look like section.key=value, got ['=3']"),  # was "Key '' not in RunConfig"
        (["optim.lr=-1"], "lr > 0"),
        (["parallel.token_dispatcher=flex"], "config key 'token_dispatcher' in section 'parallel'"),
        (["rollout.dtype=fp16"], "config key 'dtype' in section 'rollout'"),
        (["parallel.overlap_param_gather=true"], "overlap_param_gather needs parallel.distributed_optimizer"),
        (
            ["parallel.overlap_param_gather=true", "parallel.distributed_optimizer=true"],
            "parallel.overlap_param_gather needs parallel.overlap_grad_reduce=true",
        ),
        (["parallel.align_param_gather=true"], "align_param_gather=true applies to overlap_param_gather"),
        (["engine.recompute_modules=[core_attn]"], "apply to recompute_granularity=selective only"),
        (
            ["engine.recompute_granularity=selective", "engine.recompute_modules=[attn]"],
            "engine.recompute_modules: ['attn'] is not a part of a Qwen3-MoE layer",
        ),
    ],
)
def test_load_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, overrides)
    assert message in str(err.value)


RECOMPUTE = ["algorithm.old_logprobs=recompute", "rc.method=tis", "rc.level=sequence"]


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["parallel.tensor_parallel=2"], 1, "impossible layout for 1 process(es)"),
        (["parallel.expert_parallel=2"], 3, "impossible layout for 3 process(es)"),
        (["parallel.expert_parallel=3"], 3, "does not divide the 8 experts"),
        (["parallel.pipeline_parallel=0"], 1, "pipeline_parallel must be >= 1"),
        (["parallel.pipeline_parallel=2"], 3, "tensor_parallel x pipeline_parallel = 1 x 2"),
        (["parallel.pipeline_parallel=2", "parallel.expert_parallel=2"], 2, "pipeline_parallel = 1 x 2 x 2"),
        (["parallel.pipeline_parallel=3"], 3, "does not divide the 2 transformer layers"),
        (
            ["parallel.pipeline_parallel=3", "model.overrides.num_layers=6", "parallel.first_stage_layers=1"],
            3,
            "parallel.first_stage_layers=1 leaves 5 of the 6 layers, not divisible by the 2 other stage(s)",
        ),
        (
            ["parallel.pipeline_parallel=2", "model.overrides.num_layers=6", "parallel.virtual_pipeline=2"],
            2,
            "parallel.virtual_pipeline=2 does not divide the 3 layers of pipeline stage 0",
        ),
        (["parallel.pipeline_parallel=2"], 2, "sft.target_accuracy with parallel.pipeline_parallel=2"),
        (
            ["parallel.pipeline_parallel=2", "sft.target_accuracy=null", "drift.enabled=true"],
            2,
            "drift.enabled with parallel.pipeline_parallel=2",
        ),
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
        (
            ["algorithm.routing_replay=r3", "engine.fused_kernels=true", "engine.use_te=false"],
            1,
            "engine.fused_kernels needs the TransformerEngine spec (use_te)",
        ),
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
        (["model.ref_hf_path=/x"], 1, "model.ref_hf_path is set but nothing uses a reference model"),
        (["model.ref_offload=true"], 1, "(or add_token_level_kl) or remove model.ref_offload"),
        (["algorithm.use_kl_loss=true", "algorithm.kl_estimator=k4"], 1, "valid: k1, k2, k3, low_var_kl"),
        (["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=-1"], 1, "kl_loss_coef must be >= 0"),
        (["algorithm.ppo_epochs=0"], 1, "algorithm.ppo_epochs must be >= 1"),
        (["algorithm.reward_norm=batch"], 1, "use adv_estimator=reinforce for another normalisation"),
        (["algorithm.reward_norm=whiten"], 1, "valid: group, batch, running, none or null"),
        (["algorithm.reward_shift=true", "algorithm.reward_scale=true"], 1, "set one"),
        (
            ["algorithm.adv_estimator=reinforce", "algorithm.reward_shift=true"],
            1,
            "nothing to shift or scale",
        ),
        (["algorithm.reward_shift=0.5"], 1, "config key 'reward_shift' in section 'algorithm'"),
        (["algorithm.adv_estimator=gae"], 1, "config key 'adv_estimator' in section 'algorithm'"),
        (
            ["algorithm.dual_clip_loss=true", "algorithm.loss_options.clip_ratio_c=3"],
            1,
            "both set the dual clip; keep one",
        ),
        (["algorithm.add_token_level_kl=true"], 1, "use loss_type=gspo_token"),
        (
            [
                "algorithm.add_token_level_kl=true",
                "algorithm.loss_type=gspo_token",
                "algorithm.kl_ctl=adaptive",
            ],
            1,
            "algorithm.kl_ctl=adaptive needs algorithm.target_kl > 0",
        ),
        (
            [
                "algorithm.add_token_level_kl=true",
                "algorithm.loss_type=gspo_token",
                "algorithm.kl_penalty=kl",
            ],
            1,
            "algorithm.kl_penalty='kl'; valid: k1",
        ),
        (["algorithm.aux_loss_coeff=-0.001"], 1, "aux_loss_coeff must be >= 0"),
        (
            ["algorithm.rollout_correction.method=tis", "algorithm.rollout_correction.level=sequence"],
            1,
            "algorithm.rollout_correction.method='tis' needs algorithm.old_logprobs=recompute",
        ),
        (
            ["algorithm.rollout_correction.method=tis", "algorithm.old_logprobs=recompute"],
            1,
            "algorithm.rollout_correction.level=token with loss 'gspo'",
        ),
        (
            [*RECOMPUTE, "rc.cap=0"],
            1,
            "algorithm.rollout_correction.cap must be >= 1",
        ),
        ([*RECOMPUTE, "rc.method=reject", "rc.low=0.9", "rc.high=0.95"], 1, "0 <= low <= 1 <= high"),
        ([*RECOMPUTE, "rc.method=reject", "rc.cap=2"], 1, "algorithm.rollout_correction.cap does not apply"),
        ([*RECOMPUTE, "rc.method=icepop", "rc.level=token"], 1, "icepop is token-level only"),
        (["rollout.quantization=fp8", "weight_sync.method=disk"], 1, "rollout.quantization=fp8 quantises"),
        (["weight_sync.release_timeout_s=0"], 1, "weight_sync.release_timeout_s must be > 0 seconds, got 0"),
        (["rollout.quantization=int4"], 1, "key 'quantization' in section 'rollout': Invalid value 'int4'"),
        ([*RECOMPUTE, "rc.high=.inf"], 1, "every number in the config must be finite"),
        ([*RECOMPUTE, "rc.method=trunc"], 1, "config key 'method' in section 'algorithm.rollout_correction'"),
        (
            ["parallel.tensor_parallel=2", "engine.use_te=true", "engine.fused_kernels=true"],
            2,
            "expert tensor parallel 2 (parallel.expert_tensor_parallel, default tensor_parallel) with",
        ),
        (["parallel.context_parallel=0"], 1, "parallel.context_parallel must be >= 1, got 0"),
        (
            ["parallel.context_parallel=2", "parallel.pipeline_parallel=2"],
            4,
            "context parallelism is supported without pipeline stages only",
        ),
        (
            ["parallel.context_parallel=3"],
            2,
            "tensor_parallel x pipeline_parallel x context_parallel = 1 x 1 x 3",
        ),
        (
            ["parallel.context_parallel=2", "engine.use_te=false"],
            2,
            "parallel.context_parallel=2 with engine.use_te=false: megatron's local attention cannot attend",
        ),
        (
            ["parallel.context_parallel=2", "drift.enabled=true"],
            2,
            "parallel.context_parallel=2 with drift.enabled: each rank routes only its part",
        ),
    ],
)
def test_validation_errors(overrides, world, message):
    overrides = [o.replace("rc.", "algorithm.rollout_correction.", 1) for o in overrides]
    try:
        cfg = load_config(DEMO, overrides)
    except ConfigError as err:  # some are caught by a component's own check while loading
        assert message in str(err)
        return
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=world)
    assert message in str(err.value)


def test_bf16_on_both_sides_validates_on_cpu():
    cfg = load_config(DEMO, ["engine.dtype=bf16", "rollout.dtype=bf16"])
    validate(cfg)
    cfg.engine.check_hardware()  # bf16 needs no GPU: megatron's mixed precision runs on CPU
    assert (cfg.engine.dtype, cfg.rollout.dtype) == ("bf16", "bf16")


def test_valid_parallel_layout_for_two_ranks():
    check(["parallel.expert_parallel=2"], world_size=2)
    check(["parallel.tensor_parallel=2"], world_size=2)
    fixed_sft = "sft.target_accuracy=null"  # the held-out check generates with the whole model
    check(["parallel.pipeline_parallel=2", fixed_sft], world_size=2)
    check(["parallel.pipeline_parallel=2", "parallel.expert_parallel=2", fixed_sft], world_size=4)
    vpp = ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2", "model.overrides.num_layers=4"]
    check([*vpp, fixed_sft, "algorithm.routing_replay=r3"], world_size=2)
    gpu = ["parallel.tensor_parallel=2", "engine.use_te=true", "engine.fused_kernels=true"]
    check([*gpu, "parallel.expert_tensor_parallel=1"], world_size=2)  # grouped GEMM with expert TP 1
    check([*gpu[:2], "engine.fused_kernels=false"], world_size=2)  # expert TP 2 without grouped GEMM


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent.yaml")


def test_rollout_correction_configs_that_apply():
    rc = "algorithm.rollout_correction"
    recompute = "algorithm.old_logprobs=recompute"
    check([recompute, f"{rc}.method=tis", f"{rc}.level=sequence", f"{rc}.cap=1.5"])
    check([recompute, f"{rc}.method=reject", f"{rc}.level=sequence", f"{rc}.low=0.999", f"{rc}.high=1.001"])
    check([recompute, f"{rc}.method=icepop"], path=GRPO)
    check([recompute, f"{rc}.method=tis"], path=GRPO)  # token level composes with token ratios
    cfg = load_config(GRPO, [recompute, f"{rc}.method=icepop", f"{rc}.high=8"])
    built = cfg.algorithm.rollout_correction.build()
    assert (built.method, built.level, built.low, built.high) == ("icepop", "token", 0.5, 8.0)
    assert not load_config(DEMO).algorithm.rollout_correction.build().enabled  # off by default


BUDGET = "trainer.max_tokens_per_micro_batch"


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        # The demo's longest row: prompt (6) + BOS + max_new_tokens (4) = 11 tokens.
        (
            [f"{BUDGET}=10"],
            1,
            f"{BUDGET}=10 is below the longest possible row: prompt (6) + BOS + rollout.max_new_tokens (4) "
            "= 11 tokens, 11 positions packed",
        ),
        # Sequence parallelism over TP 2 pads the 11 tokens to 12 positions.
        (
            [f"{BUDGET}=11", "parallel.tensor_parallel=2"],
            2,
            "= 11 tokens, 12 positions packed (rows pad to a multiple of the sequence-parallel TP 2)",
        ),
        ([f"{BUDGET}=-5"], 1, f"{BUDGET} must be a positive int"),
        (
            [f"{BUDGET}=64", "trainer.micro_batch_size=4"],
            1,
            f"trainer.micro_batch_size=4 and {BUDGET}=64 both cut micro-batches",
        ),
    ],
)
def test_token_budget_errors_name_the_field(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        check(overrides, world_size=world)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "overrides, world",
    [
        ([f"{BUDGET}=11"], 1),  # exactly the longest row
        ([f"{BUDGET}=12", "parallel.tensor_parallel=2"], 2),
        ([f"{BUDGET}=0"], 1),  # off
        ([f"{BUDGET}=null"], 1),  # off
    ],
)
def test_token_budget_accepted(overrides, world):
    check(overrides, world_size=world)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sft.target_accuracy=0"], "sft.target_accuracy=0.0 must be in (0, 1]"),
        (["sft.target_accuracy=1.5"], "sft.target_accuracy=1.5 must be in (0, 1]"),
        (["sft.target_accuracy=0.4", "sft.steps=0"], "sft.steps is the cap"),
        (["sft.target_accuracy=0.4", "sft.check_every=0"], "sft.check_every must be >= 1"),
        (["sft.check_every=-1"], "sft.check_every must be >= 1"),
        (["sft.target_window=0"], "sft.target_window must be >= 1"),
        (["sft.target_accuracy=high"], "config key 'target_accuracy' in section 'sft'"),
    ],
)
def test_sft_target_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check(overrides)


def test_sft_target_accepted():
    check(["sft.target_accuracy=1.0", "sft.steps=1", "sft.check_every=1"])


ROLL_GSPO_BLOCK = {  # ROLL's published GSPO configuration, its keys and values
    "adv_estimator": "reinforce",
    "importance_sampling": "seq",
    "rollout_batch_size": 64,
    "num_return_sequences_in_group": 8,
    "prompt_length": 2048,
    "response_length": 4096,
    "ppo_epochs": 1,
    "use_kl_loss": True,
    "kl_loss_coef": 0.001,
    "loss_agg_mode": "seq-mean-token-sum",
    "whiten_advantages": True,
    "advantage_clip": 2.0,
    "dual_clip_loss": True,
    "reward_clip": 10,
    "reward_norm": None,
    "reward_shift": False,
    "reward_scale": False,
    "add_token_level_kl": False,
}
SCALED = {"rollout_batch_size", "prompt_length", "response_length"}  # sizes the configs may scale


def roll_value(cfg, key):
    """The value of ROLL's `key` in a RunConfig (the table of ROLL's keys in docs/algorithms.md)."""
    if key == "importance_sampling":
        return "seq" if cfg.algorithm.loss_type == "gspo" else "token"
    if key == "num_return_sequences_in_group":
        return cfg.rollout.group_size
    if key == "rollout_batch_size":
        return cfg.rollout.rollout_batch_size
    if key == "response_length":
        return cfg.rollout.max_new_tokens
    return getattr(cfg.algorithm, key)


@pytest.mark.parametrize(
    "name,scaled", [("roll_gspo_tiny_cpu.yaml", True), ("qwen3_30b_a3b_gspo_roll.yaml", False)]
)
def test_roll_gspo_configs_hold_rolls_block(name, scaled, tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text('{"problem": "What is $1+1$?", "answer": "2"}\n')
    cfg = load_config(REPO / "configs" / name, [] if scaled else [f"task.options.path={data}"])
    validate(cfg, world_size=1 if scaled else 16)
    for key, value in ROLL_GSPO_BLOCK.items():
        if key == "prompt_length" or (scaled and key in SCALED):
            continue
        assert roll_value(cfg, key) == value, key
    if scaled:
        assert cfg.rollout.rollout_batch_size < 64 and cfg.rollout.max_new_tokens < 4096


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (  # the 235B config's batch cap under the default control-group timeout
            ["rollout.request_timeout_s=7200", "rollout.batch_timeout_s=14400"],
            "rollout.batch_timeout_s=14400 s: the other ranks wait that long for rank 0's rollouts on the "
            "control group, which parallel.timeout_minutes=120 aborts first (600 s must be left for "
            "scoring); raise parallel.timeout_minutes to >= 250 or lower rollout.batch_timeout_s to <= 6600",
        ),
        (["rollout.batch_timeout_s=7200"], "parallel.timeout_minutes to >= 130"),
        (["parallel.timeout_minutes=30"], "lower rollout.batch_timeout_s to <= 1200"),
        (
            ["rollout.request_timeout_s=900", "rollout.batch_timeout_s=600"],
            "rollout.request_timeout_s=900 exceeds rollout.batch_timeout_s=600: the batch cap cuts a "
            "generation off before it can time out and be retried; lower rollout.request_timeout_s",
        ),
    ],
)
def test_rollout_timeouts_must_fit_the_control_group_timeout(overrides, message):
    with pytest.raises(ConfigError) as err:
        check(overrides)
    assert message in str(err.value)


def test_rollout_timeouts_that_fit_are_accepted():
    check(["rollout.batch_timeout_s=14400", "parallel.timeout_minutes=250"])
    check(["rollout.request_timeout_s=600", "rollout.batch_timeout_s=600", "parallel.timeout_minutes=20"])


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_has_consistent_timeouts(path):
    cfg = load_config(path)
    check_rollout_timeouts(cfg.rollout, cfg.parallel.timeout_minutes)


def test_allgather_dispatcher_under_pipeline_parallelism_is_refused_by_name():
    """megatron-core refuses allgather with variable_seq_lengths, which PP > 1 sets, only at model build."""
    with pytest.raises(ConfigError) as err:
        check(["parallel.token_dispatcher=allgather", "parallel.pipeline_parallel=2"], world_size=2)
    assert (
        "parallel.token_dispatcher=allgather with pipeline_parallel=2: megatron-core's allgather dispatcher "
        "does not support the variable sequence lengths pipeline stages exchange; use "
        "parallel.token_dispatcher=alltoall"
    ) in str(err.value)
    check(["parallel.token_dispatcher=allgather", "parallel.expert_parallel=2"], world_size=2)


def test_a_mapping_override_replaces_the_yaml_mapping():
    tiny_yaml = Path(__file__).resolve().parents[1] / "configs" / "tiny_moe_cpu.yaml"
    assert load_config(tiny_yaml).model.overrides == {"vocab_size": 80}
    assert load_config(tiny_yaml, ["model.overrides={}"]).model.overrides == {}
    one_key = load_config(tiny_yaml, ["model.overrides.num_layers=3"]).model.overrides
    assert one_key == {"vocab_size": 80, "num_layers": 3}  # a single key still merges
    assert load_config(tiny_yaml, ["model.overrides={num_layers: 3}"]).model.overrides == {"num_layers": 3}
    in_order = load_config(tiny_yaml, ["task.options={max_sum: 30}", "task.options.max_prompt_len=40"])
    assert in_order.task.options == {"max_sum": 30, "max_prompt_len": 40}  # a later key is kept
    replaced = load_config(tiny_yaml, ["task.options.max_prompt_len=40", "task.options={max_sum: 30}"])
    assert replaced.task.options == {"max_sum": 30}  # a later mapping replaces


def test_hf_path_leaves_no_preset_in_the_config_it_saves(tmp_path):
    """config.yaml (and `report`, which shows it) showed `preset: tiny` beside the hf_path used."""
    cfg = load_config(DEMO, [f"model.hf_path={tmp_path}"])
    assert cfg.model.preset is None
    saved = yaml.safe_load(to_yaml(cfg))["model"]
    assert saved["preset"] is None and saved["hf_path"] == str(tmp_path)
    assert load_config(DEMO).model.preset == "tiny"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.server_urls=[http://10.0.0.5:30000]"], "starts the run's own SGLang servers"),
        (["rollout.sglang_max_total_tokens=0"], "rollout.sglang_max_total_tokens must be >= 1, got 0"),
        (["rollout.quantization=fp8"], "rollout.quantization=fp8 needs servers launched from a block-FP8"),
    ],
)
def test_engine_sglang_refuses_what_it_cannot_start(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check(["rollout.engine=sglang", *overrides])


def test_engine_sglang_validates_on_the_demo():
    check(
        ["rollout.engine=sglang", "rollout.dtype=bf16", "rollout.sglang_args=[--mem-fraction-static, '0.5']"]
    )
