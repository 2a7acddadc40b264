"""The run configuration: its schema, loading with overrides, and every start-up check of it.

    cfg = load_config("configs/tiny_moe_cpu.yaml", ["trainer.steps=3"])
    validate(cfg, world_size=1)

- `schema`: the dataclasses nested into one `RunConfig` (every key, its type, default and meaning);
- `loading`: YAML through OmegaConf plus dotlist overrides -> `RunConfig`; what a config builds
  (the model config, the task);
- `value_checks`: what each value must be on its own (finite, positive, URLs, sizes);
- `validate`: what depends on several fields or on the world size.
"""

from megatron_gspo.config.loading import (
    build_model_config,
    build_task,
    load_config,
    prompts_start_with_bos,
    to_yaml,
)
from megatron_gspo.config.schema import (
    AlgorithmConfig,
    DebugConfig,
    DriftConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    RunConfig,
    SFTConfig,
    TaskConfig,
    TrainerConfig,
    WandbConfig,
    WeightSyncConfig,
)
from megatron_gspo.config.validate import (
    effective_reward_norm,
    needs_reference,
    policy_loss_options,
    validate,
)
from megatron_gspo.config.value_checks import CONTROL_MARGIN_S, ValueCheckError, check_rollout_timeouts
from megatron_gspo.errors import ConfigError

__all__ = [
    "CONTROL_MARGIN_S",
    "AlgorithmConfig",
    "ConfigError",
    "DebugConfig",
    "DriftConfig",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunConfig",
    "SFTConfig",
    "TaskConfig",
    "TrainerConfig",
    "ValueCheckError",
    "WandbConfig",
    "WeightSyncConfig",
    "build_model_config",
    "build_task",
    "check_rollout_timeouts",
    "effective_reward_norm",
    "load_config",
    "prompts_start_with_bos",
    "needs_reference",
    "policy_loss_options",
    "to_yaml",
    "validate",
]
