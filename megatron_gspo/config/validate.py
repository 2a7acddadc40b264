"""`validate`: the start-up checks of a `RunConfig` that depend on several fields or on the world size.

Errors say what is wrong and why (`ConfigError`, naming the fields); the checks of single
values are `config.value_checks`.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_gspo.config.colocation import check_colocation
from megatron_gspo.config.loading import build_model_config, build_task, prompts_start_with_bos
from megatron_gspo.config.schema import AlgorithmConfig, RolloutConfig, RunConfig, SFTConfig
from megatron_gspo.config.value_checks import (
    ValueCheckError,
    check_eval,
    check_finite,
    check_model_sizes,
    check_rollout,
    check_rollout_timeouts,
    check_weight_sync,
)
from megatron_gspo.errors import ConfigError
from megatron_gspo.model.fp8.serving import Fp8ServingError, check_fp8_serving
from megatron_gspo.optional import installed, missing_message


def _dry_run_loss(loss_type: str, options: dict[str, Any]) -> None:
    """The policy loss on one two-token response, so bad option values fail at start-up."""
    import torch

    from megatron_gspo.algorithms import compute_policy_loss

    zeros, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    compute_policy_loss(loss_type, zeros, zeros, torch.zeros(1), mask, **options)


def validate(cfg: RunConfig, world_size: int = 1) -> None:
    """Check what spans several fields or depends on the world size; raises `ConfigError` naming the field."""
    from megatron_gspo.algorithms import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, REWARD_NORMS
    from megatron_gspo.algorithms.aggregation import TOKEN_SUM_AGG_MODES
    from megatron_gspo.tasks import available_tasks

    algo, rollout, trainer = cfg.algorithm, cfg.rollout, cfg.trainer
    if rollout.max_staleness < 0:
        raise ConfigError(f"rollout.max_staleness={rollout.max_staleness}: must be >= 0 (0: lock-step)")
    if rollout.update_mode != "drain" and not rollout.max_staleness:
        raise ConfigError(
            f"rollout.update_mode={rollout.update_mode} needs rollout.max_staleness >= 1 (in lock-step no "
            "request is in flight at a sync); set rollout.max_staleness or drop rollout.update_mode"
        )
    if rollout.mask_stale_segments and rollout.update_mode != "partial":
        raise ConfigError(
            f"rollout.mask_stale_segments=true needs rollout.update_mode=partial (only partial rollouts "
            f"have segments), got rollout.update_mode={rollout.update_mode}"
        )
    if cfg.model.hf_path and cfg.model.overrides:
        raise ConfigError("model.overrides only apply to a preset; with model.hf_path the checkpoint decides")
    model_cfg = build_model_config(cfg)
    try:
        check_finite(cfg)
        check_model_sizes(model_cfg)
        check_rollout(cfg.rollout)
        check_eval(cfg.eval)
        check_weight_sync(cfg.weight_sync, cfg.rollout)
        check_rollout_timeouts(cfg.rollout, cfg.parallel.timeout_minutes)
    except ValueCheckError as err:
        raise ConfigError(str(err)) from None
    _check_fp8_rollouts(cfg.rollout)
    check_colocation(
        cfg, world_size=world_size, devices_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    )
    if cfg.optim.use_precision_aware_optimizer and not cfg.parallel.distributed_optimizer:
        raise ConfigError(
            "optim.use_precision_aware_optimizer needs parallel.distributed_optimizer=true "
            "(megatron keeps its lower-precision main weights in the distributed optimizer's shards)"
        )
    if cfg.logging.tensorboard and not installed("tensorboard"):
        raise ConfigError(
            missing_message("tensorboard", "logging.tensorboard (on by default)")
            + ", or set logging.tensorboard=false"
        )
    if cfg.logging.wandb.project is not None and cfg.logging.wandb.mode != "disabled":
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                "logging.wandb.project is set but the wandb package is not installed: "
                "pip install 'megatron-gspo[wandb]', or unset logging.wandb.project"
            )
    try:
        dp = cfg.parallel.check_world_size(world_size)
    except ValueError as err:
        raise ConfigError(f"parallel: impossible layout for {world_size} process(es): {err}") from None
    if model_cfg.num_experts % cfg.parallel.expert_parallel:
        raise ConfigError(
            f"parallel.expert_parallel={cfg.parallel.expert_parallel} does not divide "
            f"the {model_cfg.num_experts} experts of each layer"
        )
    try:
        cfg.parallel.check_num_layers(model_cfg.num_layers)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_pipeline(cfg)
    _check_context_parallel(cfg)
    if model_cfg.num_query_groups % cfg.parallel.tensor_parallel:
        raise ConfigError(
            f"parallel.tensor_parallel={cfg.parallel.tensor_parallel} does not divide the "
            f"{model_cfg.num_query_groups} key/value heads"
        )

    if algo.loss_type not in POLICY_LOSSES:
        raise ConfigError(
            f"algorithm.loss_type={algo.loss_type!r} is not a registered loss; "
            f"supported: {', '.join(POLICY_LOSSES.names())}"
        )
    spec = POLICY_LOSSES.get(algo.loss_type)
    unknown = sorted(set(algo.loss_options) - set(spec.options))
    if unknown:
        raise ConfigError(
            f"algorithm.loss_options {unknown} do not apply to loss {algo.loss_type!r}; "
            f"its options: {', '.join(spec.options) or 'none'}"
        )
    try:  # option values (types, ranges) are the loss's own to check: run it once on a dummy batch
        _dry_run_loss(algo.loss_type, algo.loss_options)
    except ValueError as err:
        raise ConfigError(f"algorithm.loss_options of {algo.loss_type!r}: {err}") from None
    _check_rollout_correction(algo, spec.sequence_ratio)
    mode = algo.loss_agg_mode or spec.default_agg_mode
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(f"algorithm.loss_agg_mode={mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    if spec.sequence_ratio and mode in TOKEN_SUM_AGG_MODES and not algo.allow_token_sum_for_gspo:
        raise ConfigError(
            f"algorithm.loss_agg_mode={mode!r} with loss_type={algo.loss_type!r}: a token-sum aggregation "
            "weights each response by its length, which GSPO's length-normalised sequence ratio is meant to "
            "avoid; use seq-mean-token-mean (as published) or set algorithm.allow_token_sum_for_gspo=true"
        )
    if algo.reward_norm is not None and algo.reward_norm not in REWARD_NORMS:
        raise ConfigError(
            f"algorithm.reward_norm={algo.reward_norm!r}; valid: {', '.join(REWARD_NORMS)} or null"
        )
    if algo.adv_estimator == "grpo" and algo.reward_norm not in (None, "group"):
        raise ConfigError(
            f"algorithm.reward_norm={algo.reward_norm!r} with adv_estimator=grpo: grpo normalises per group "
            "(as ROLL does whatever reward_norm says); use adv_estimator=reinforce for another normalisation"
        )
    if algo.reward_shift and algo.reward_scale:
        raise ConfigError(
            "algorithm.reward_shift and algorithm.reward_scale: one normalises by the mean only, the other "
            "by the std only; set one"
        )
    if (algo.reward_shift or algo.reward_scale) and effective_reward_norm(algo) == "none":
        raise ConfigError(
            "algorithm.reward_shift / reward_scale choose how reward_norm normalises; with adv_estimator="
            "reinforce and reward_norm=null there is nothing to shift or scale"
        )
    if algo.dual_clip_loss and "clip_ratio_c" in algo.loss_options:
        raise ConfigError(
            "algorithm.dual_clip_loss and algorithm.loss_options.clip_ratio_c both set the dual clip; "
            "keep one"
        )
    if algo.dual_clip_loss and "clip_ratio_c" not in spec.options:
        raise ConfigError(
            f"algorithm.dual_clip_loss with loss_type={algo.loss_type!r}: that loss has no hard clip "
            "to dual-clip"
        )
    if algo.kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(f"algorithm.kl_estimator={algo.kl_estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    if algo.num_mini_batches < 1:
        raise ConfigError(f"algorithm.num_mini_batches must be >= 1, got {algo.num_mini_batches}")
    if algo.ppo_epochs < 1:
        raise ConfigError(f"algorithm.ppo_epochs must be >= 1 (passes over the batch), got {algo.ppo_epochs}")
    if algo.aux_loss_coeff < 0:
        raise ConfigError(f"algorithm.aux_loss_coeff must be >= 0 (0: off), got {algo.aux_loss_coeff}")
    _check_expert_tp(cfg)
    if algo.routing_replay != "none" and cfg.engine.router_fusion:
        raise ConfigError(
            "algorithm.routing_replay with engine.router_fusion: the fused router top-k silently bypasses "
            "the replayed expert choice; set engine.router_fusion=false"
        )

    if rollout.group_size < 2:
        raise ConfigError(
            f"rollout.group_size={rollout.group_size}: group advantages need at least 2 responses per prompt"
        )
    if rollout.rollout_batch_size < 1:
        raise ConfigError(f"rollout.rollout_batch_size must be >= 1, got {rollout.rollout_batch_size}")
    responses = rollout.rollout_batch_size * rollout.group_size
    if responses % (algo.num_mini_batches * dp):
        raise ConfigError(
            f"rollout_batch_size x group_size = {responses} responses do not split into "
            f"algorithm.num_mini_batches={algo.num_mini_batches} mini-batches x {dp} data-parallel rank(s)"
        )
    if rollout.temperature <= 0:
        raise ConfigError(
            f"rollout.temperature={rollout.temperature}: training needs sampled log-probs (temperature > 0)"
        )
    if not 0 < rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {rollout.top_p}")
    if rollout.max_new_tokens < 1:
        raise ConfigError(f"rollout.max_new_tokens must be >= 1, got {rollout.max_new_tokens}")
    if trainer.micro_batch_size < 0:
        raise ConfigError(f"trainer.micro_batch_size must be >= 0, got {trainer.micro_batch_size}")
    budget = trainer.max_tokens_per_micro_batch or 0
    if budget < 0:
        raise ConfigError(
            f"trainer.max_tokens_per_micro_batch must be a positive int (0 or null: off), got {budget}"
        )
    if budget and trainer.micro_batch_size:
        raise ConfigError(
            f"trainer.micro_batch_size={trainer.micro_batch_size} and trainer.max_tokens_per_micro_batch="
            f"{budget} both cut micro-batches; set one of them (the other 0)"
        )
    if trainer.steps < 0 or trainer.save_every < 0 or cfg.eval.every < 0 or trainer.keep_last < 1:
        raise ConfigError(
            "trainer.steps, trainer.save_every and eval.every must be >= 0, trainer.keep_last >= 1"
        )
    if trainer.reshardable_every < 0:
        raise ConfigError(
            f"trainer.reshardable_every must be >= 0 (0: never), got {trainer.reshardable_every}"
        )
    if cfg.sft.steps < 0 or cfg.sft.batch_size < 1 or cfg.sft.lr <= 0:
        raise ConfigError("sft.steps must be >= 0, sft.batch_size >= 1 and sft.lr > 0")
    _check_sft_target(cfg.sft)
    if cfg.sft.batch_size % dp:
        raise ConfigError(f"sft.batch_size={cfg.sft.batch_size} does not split over {dp} data-parallel ranks")
    if cfg.eval.num_problems < 1:
        raise ConfigError(f"eval.num_problems must be >= 1, got {cfg.eval.num_problems}")
    _check_reference(cfg)
    _check_token_level_kl(algo, spec.sequence_ratio)
    if cfg.task.name not in available_tasks():
        raise ConfigError(f"task.name={cfg.task.name!r}; available: {', '.join(available_tasks())}")
    task = build_task(cfg)
    bos = prompts_start_with_bos(cfg)
    longest = task.max_prompt_len + int(bos) + rollout.max_new_tokens
    if longest > model_cfg.max_position_embeddings:
        raise ConfigError(
            f"prompt (task.options.max_prompt_len or the task's, {task.max_prompt_len}){' + BOS' * bos} + "
            f"rollout.max_new_tokens ({rollout.max_new_tokens}) = {longest} exceeds the model's "
            f"max_position_embeddings={model_cfg.max_position_embeddings}"
        )
    pad = cfg.parallel.tensor_parallel if cfg.parallel.use_sequence_parallel else 1
    packed = -(-longest // pad) * pad  # sequence parallelism pads every row to a multiple of TP
    if 0 < budget < packed:
        raise ConfigError(
            f"trainer.max_tokens_per_micro_batch={budget} is below the longest possible row: prompt "
            f"({task.max_prompt_len}){' + BOS' * bos} + rollout.max_new_tokens "
            f"({rollout.max_new_tokens}) = {longest} "
            f"tokens, {packed} positions packed (rows pad to a multiple of the sequence-parallel TP {pad})"
        )


ROLL_DUAL_CLIP_C = 1 + 2 * 0.2
"""ROLL's dual-clip bound: 1 + 2 x pg_clip with its default pg_clip 0.2."""


def effective_reward_norm(algo: AlgorithmConfig) -> str:
    """The normalisation `compute_group_advantages` runs: group for grpo, reward_norm (null: none) else."""
    if algo.adv_estimator == "grpo":
        return "group"
    return algo.reward_norm or "none"


def policy_loss_options(algo: AlgorithmConfig) -> dict[str, Any]:
    """The policy loss's options, with `dual_clip_loss` as ROLL's `clip_ratio_c`."""
    if algo.dual_clip_loss:
        return {**algo.loss_options, "clip_ratio_c": ROLL_DUAL_CLIP_C}
    return dict(algo.loss_options)


def _check_token_level_kl(algo: AlgorithmConfig, sequence_ratio: bool) -> None:
    """The reward-side KL gives per-token advantages: a loss that takes them, a valid controller."""
    if not algo.add_token_level_kl:
        return
    if algo.loss_type == "gspo":
        raise ConfigError(
            "algorithm.add_token_level_kl with loss_type=gspo: the reward-side KL makes the advantages per "
            "token and gspo takes one per response; use loss_type=gspo_token (GSPO's ratio, per-token "
            "advantages) or grpo"
        )
    from megatron_gspo.algorithms import KL_ESTIMATORS

    if algo.kl_penalty not in KL_ESTIMATORS:
        raise ConfigError(f"algorithm.kl_penalty={algo.kl_penalty!r}; valid: {', '.join(KL_ESTIMATORS)}")
    if algo.init_kl_coef < 0:
        raise ConfigError(f"algorithm.init_kl_coef must be >= 0, got {algo.init_kl_coef}")
    if algo.kl_ctl == "adaptive" and (algo.target_kl is None or algo.target_kl <= 0 or algo.kl_horizon < 1):
        raise ConfigError(
            "algorithm.kl_ctl=adaptive needs algorithm.target_kl > 0 and algorithm.kl_horizon >= 1, got "
            f"target_kl={algo.target_kl}, kl_horizon={algo.kl_horizon}"
        )


def needs_reference(algo: AlgorithmConfig) -> bool:
    """Whether the run builds the reference model (the KL loss or the reward-side KL)."""
    return algo.use_kl_loss or algo.add_token_level_kl


def _check_reference(cfg: RunConfig) -> None:
    """The reference model's keys apply only when something uses the reference."""
    if needs_reference(cfg.algorithm):
        if cfg.algorithm.kl_loss_coef < 0:
            raise ConfigError(f"algorithm.kl_loss_coef must be >= 0, got {cfg.algorithm.kl_loss_coef}")
        return
    for key in ("ref_hf_path", "ref_offload"):
        if getattr(cfg.model, key):
            raise ConfigError(
                f"model.{key} is set but nothing uses a reference model: set algorithm.use_kl_loss=true "
                f"(or add_token_level_kl) or remove model.{key}"
            )


def _check_pipeline(cfg: RunConfig) -> None:
    """What pipeline parallelism does not run: passes that need the whole model on one rank."""
    if cfg.parallel.pipeline_parallel == 1:
        return
    pp = f"parallel.pipeline_parallel={cfg.parallel.pipeline_parallel}"
    if cfg.sft.steps > 0 and cfg.sft.target_accuracy is not None:
        raise ConfigError(
            f"sft.target_accuracy with {pp}: the held-out check generates greedily with the trainer's "
            "model, which needs every layer on one rank; set sft.target_accuracy=null (fixed sft.steps)"
        )
    if cfg.drift.enabled:
        raise ConfigError(
            f"drift.enabled with {pp}: drift metrics need every layer's routing of a token on one rank"
        )


def _check_context_parallel(cfg: RunConfig) -> None:
    """What context parallelism does not run: the local spec, passes that need whole sequences."""
    cp = cfg.parallel.context_parallel
    if cp == 1:
        return
    name = f"parallel.context_parallel={cp}"
    if cfg.engine.use_te is False:
        raise ConfigError(
            f"{name} with engine.use_te=false: megatron's local attention cannot attend across "
            "context-parallel ranks; context parallelism needs the TransformerEngine spec"
        )
    if cfg.drift.enabled:
        raise ConfigError(f"{name} with drift.enabled: each rank routes only its part of every sequence")
    if cfg.sft.steps > 0 and cfg.sft.target_accuracy is not None:
        raise ConfigError(
            f"sft.target_accuracy with {name}: the held-out check generates with the trainer's model "
            "on whole sequences; set sft.target_accuracy=null (fixed sft.steps)"
        )


def _check_sft_target(sft: SFTConfig) -> None:
    """The early stop of the cold start: a reachable target, a cap, a check interval."""
    if sft.check_every < 1:
        raise ConfigError(
            f"sft.check_every must be >= 1 (steps between accuracy checks), got {sft.check_every}"
        )
    if sft.target_window < 1:
        raise ConfigError(
            f"sft.target_window must be >= 1 (checks averaged against the target), got {sft.target_window}"
        )
    if sft.target_accuracy is None:
        return
    if not 0 < sft.target_accuracy <= 1:
        raise ConfigError(
            f"sft.target_accuracy={sft.target_accuracy} must be in (0, 1] (a held-out accuracy), or null"
        )
    if sft.steps < 1:
        raise ConfigError(
            f"sft.target_accuracy={sft.target_accuracy} with sft.steps={sft.steps}: sft.steps is the cap "
            "of the early-stopped cold start and must be >= 1"
        )


def _check_rollout_correction(algo: AlgorithmConfig, sequence_ratio: bool) -> None:
    """Bounds of the correction, its level against the loss, and the recompute it needs."""
    try:
        correction = algo.rollout_correction.build()
        correction.check_loss(algo.loss_type, sequence_ratio)
    except ValueError as err:
        raise ConfigError(f"algorithm.{err}") from None
    if correction.enabled and algo.old_logprobs != "recompute":
        raise ConfigError(
            f"algorithm.rollout_correction.method={correction.method!r} needs "
            "algorithm.old_logprobs=recompute: the correction weighs pi_old / pi_rollout with pi_old the "
            "trainer's forward on the rollout weights (with old_logprobs=rollout the two are the same and "
            "every weight would be 1)"
        )


def _check_expert_tp(cfg: RunConfig) -> None:
    """Expert TP > 1 with grouped GEMM: HF import/export do not handle that weight layout yet."""
    from megatron_gspo.model.engine import KernelAvailability, wants_fused_kernels

    etp = cfg.parallel.expert_tp
    if etp > 1 and wants_fused_kernels(cfg.engine, KernelAvailability.detect()):
        raise ConfigError(
            f"expert tensor parallel {etp} (parallel.expert_tensor_parallel, default tensor_parallel) with "
            "grouped GEMM (engine.fused_kernels): HF import/export do not support that expert layout yet; "
            "set parallel.expert_tensor_parallel=1 or engine.fused_kernels=false"
        )


def _check_fp8_rollouts(rollout: RolloutConfig) -> None:
    """rollout.quantization=fp8 on real SGLang servers: a block-FP8 server checkpoint, a layout SGLang takes.

    The embedded server dequantises what it receives at any width, so only real SGLang servers
    (`rollout.server_urls` / `rollout.router_url`) are checked (`model/fp8/serving.py` says why).
    """
    if rollout.quantization != "fp8" or not (rollout.server_urls or rollout.router_url):
        return
    if rollout.server_checkpoint is None:
        raise ConfigError(
            "rollout.quantization=fp8 with SGLang servers needs rollout.server_checkpoint: the block-FP8 "
            "checkpoint the servers are launched from (launch/sglang_servers.sh MODEL, e.g. "
            "Qwen3-30B-A3B-FP8), "
            "with rollout.server_tensor_parallel / server_expert_parallel their TP / EP; a bf16 checkpoint "
            "served with --quantization fp8 drops the block scales the trainer sends"
        )
    try:
        check_fp8_serving(
            rollout.server_checkpoint, rollout.server_tensor_parallel, rollout.server_expert_parallel
        )
    except Fp8ServingError as err:
        raise ConfigError(
            f"{err} (rollout.server_checkpoint, rollout.server_tensor_parallel="
            f"{rollout.server_tensor_parallel}, rollout.server_expert_parallel="
            f"{rollout.server_expert_parallel})"
        ) from None
