"""Loading a run configuration: YAML (safely, through OmegaConf) and dotlist overrides, into a `RunConfig`.

cfg = load_config("configs/tiny_moe_cpu.yaml", ["trainer.steps=3"])
validate(cfg, world_size=1)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_gspo.config.schema import RunConfig
from megatron_gspo.errors import ConfigError
from megatron_gspo.model.config import MoEModelConfig, preset


def load_config(
    path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Read a YAML file (optional) and dotlist overrides into a typed `RunConfig`.

    Raises:
        ConfigError: an unknown section or key (named with its section), a value of the wrong
            type, a malformed override, or a component's own check (e.g. optim.lr <= 0).
    """
    schema = OmegaConf.structured(RunConfig)
    try:
        layers = [schema]
        if path is not None:
            layers.append(_load_yaml(Path(path)))
        bad = [o for o in overrides if "=" not in o or not o.split("=", 1)[0].strip()]
        if bad:
            raise ConfigError(f"overrides must look like section.key=value, got {bad}")
        merged = OmegaConf.merge(*layers)
        for override in overrides:  # in order: a later override wins over an earlier one
            key = override.split("=", 1)[0]
            layer = OmegaConf.from_dotlist([override])
            value = OmegaConf.select(layer, key)
            if isinstance(value, DictConfig):  # a whole mapping replaces what is there, not merges:
                # `model.overrides={}` clears the YAML's; `model.overrides.num_layers=3` changes one key
                OmegaConf.update(merged, key, OmegaConf.to_container(value), merge=False)
            else:
                merged = OmegaConf.merge(merged, layer)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_describe(err)) from None
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err)) from None
    if cfg.model.hf_path:  # the checkpoint decides the architecture: no preset to show as used
        cfg.model.preset = None
    return cfg


def _load_yaml(path: Path):
    """One YAML config layer; a missing file, a directory or bad YAML is a `ConfigError`."""
    if path.is_dir():
        raise ConfigError(
            f"--config {path} is a directory; give a YAML file such as configs/tiny_moe_cpu.yaml"
        )
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return OmegaConf.load(path)  # yaml.SafeLoader underneath: unknown tags are refused
    except yaml.YAMLError as err:  # syntax errors, unknown tags
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(err).split())}") from None
    except RecursionError:  # self-referencing aliases
        raise ConfigError(f"config file {path}: recursive YAML alias") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text: {err}") from None


def _describe(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None)
    message = str(err).splitlines()[0]
    if key and "." in key:
        section, name = key.rsplit(".", 1)
        return f"config key '{name}' in section '{section}': {message}"
    if key:
        sections = ", ".join(f.name for f in dataclasses.fields(RunConfig))
        return f"config key '{key}' (top level; sections: {sections}): {message}"
    return message


def to_yaml(cfg: RunConfig) -> str:
    """The config as YAML (saved next to the run's metrics)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def build_model_config(cfg: RunConfig) -> MoEModelConfig:
    """The policy architecture: read from `model.hf_path`, or the preset with its overrides."""
    from megatron_gspo.model.hf.config import HFConfigError, read_hf_config

    if cfg.model.hf_path:
        try:
            return read_hf_config(cfg.model.hf_path)
        except HFConfigError as err:
            raise type(err)(f"model.hf_path: {err}") from None
    known = {f.name for f in dataclasses.fields(MoEModelConfig)}
    unknown = sorted(set(cfg.model.overrides) - known)
    if unknown:
        raise ConfigError(
            f"model.overrides has unknown field(s) {unknown}; MoEModelConfig fields: {sorted(known)}"
        )
    if cfg.model.preset is None:
        raise ConfigError("model: set model.preset (tiny, qwen3_30b_a3b, qwen3_235b_a22b) or model.hf_path")
    try:
        return preset(cfg.model.preset, **cfg.model.overrides)
    except ValueError as err:
        raise ConfigError(f"model: {err}") from None


def prompts_start_with_bos(cfg: RunConfig) -> bool:
    """Whether the run puts a BOS before each prompt: `task.add_bos`, else whether its tokenizer has one.

    Without `model.hf_path` the demo tasks' character tokenizer (it has one); Qwen tokenizers have
    none. A tokenizer that cannot be read here counts one (training names it at start-up).
    """
    if cfg.task.add_bos is not None:
        return cfg.task.add_bos
    if not cfg.model.hf_path:
        return True
    from transformers import AutoTokenizer

    from megatron_gspo.tasks.tokenizer import resolve_add_bos

    try:
        return resolve_add_bos(None, AutoTokenizer.from_pretrained(cfg.model.hf_path))
    except (OSError, ValueError):
        return True


def build_task(cfg: RunConfig):
    """The configured task; raises `ConfigError` for an option the task does not take."""
    from megatron_gspo.tasks import get_task

    try:
        task = get_task(cfg.task.name, **cfg.task.options)
        if cfg.eval.path:
            if not hasattr(task, "use_eval_file"):
                raise ConfigError(
                    f"eval.path is for tasks read from a file (math_jsonl), not task.name={cfg.task.name!r}"
                )
            task.use_eval_file(cfg.eval.path)
        return task
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"task: {err.args[0] if err.args else err}") from None
    except OSError as err:  # a data file that is missing or unreadable
        raise ConfigError(f"task {cfg.task.name!r}: {err.filename or ''}: {err.strerror or err}") from None
