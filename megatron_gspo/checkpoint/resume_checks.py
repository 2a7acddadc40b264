"""Settings a resumed run must share with its checkpoint, checked before any heavy work.

A checkpoint's `meta.json` records its parallel layout and (readably) the trainer state with
the run's config. Resuming with a setting the saved state cannot serve is refused here, as one
line naming the setting and the value to restore, instead of failing deep inside megatron's
loader or the prompt stream:

- `parallel.distributed_optimizer`: the optimizer state is laid out per kind;
- `engine.dtype` fp32 -> bf16: a bf16 run keeps fp32 main parameters beside its bf16 weights,
  which an fp32 checkpoint does not hold (bf16 -> fp32 works: the main parameters become the
  weights);
- `rollout.rollout_batch_size` and `task.name`: the prompt stream's position is counted in
  batches of one task;
- the parallel layout of a routine checkpoint (distributed optimizer state saved as each rank
  held it, `dp_reshardable`): only a reshardable checkpoint loads at another layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from megatron_gspo.checkpoint.meta import CheckpointError, read_meta
from megatron_gspo.config import ConfigError, RunConfig


class ResumeIncompatibleError(ConfigError):
    """The run's config differs from its checkpoint's in a setting a resume cannot change."""


def _saved_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The config the checkpoint was written with (empty when it recorded none readably)."""
    state = meta.get("trainer_state") or {}
    try:
        saved = yaml.safe_load(state.get("config") or "")
    except yaml.YAMLError:
        return {}
    return saved if isinstance(saved, dict) else {}


def _get(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def resume_incompatibilities(meta: dict[str, Any], cfg: RunConfig) -> list[str]:
    """What keeps `cfg` from resuming the checkpoint `meta` describes; each names the setting to restore."""
    saved = _saved_config(meta)
    here = {
        "parallel.distributed_optimizer": cfg.parallel.distributed_optimizer,
        "engine.dtype": cfg.engine.dtype,
        "rollout.rollout_batch_size": cfg.rollout.rollout_batch_size,
        "task.name": cfg.task.name,
    }
    then = {key: _get(saved, key) for key in here}
    recorded_kind = meta.get("layout", {}).get("distributed_optimizer")
    if recorded_kind is not None:  # the layout is the authority: it is what the optimizer state has
        then["parallel.distributed_optimizer"] = recorded_kind
    problems = []
    for key, value in here.items():
        old = then[key]
        if old is None or old == value:
            continue
        if key == "engine.dtype" and (old, value) == ("bf16", "fp32"):
            continue  # the fp32 main parameters become the weights
        problems.append(f"{key}={_text(old)} (this run has {_text(value)})")
    if not problems:
        problems += _routine_layout(meta, cfg)
    return problems


def _routine_layout(meta: dict[str, Any], cfg: RunConfig) -> list[str]:
    """The layout a routine checkpoint needs, when this run's differs (call after `init_distributed`)."""
    from megatron_gspo.checkpoint.steps import current_layout, is_reshardable, layout_text

    if "layout" not in meta or is_reshardable(meta):
        return []
    here = current_layout() | {"distributed_optimizer": cfg.parallel.distributed_optimizer}
    saved = {key: {"pipeline_parallel": 1, **meta["layout"]}.get(key) for key in here}
    if saved == here:
        return []
    return [
        f"the parallel layout {layout_text(saved)} of this routine checkpoint (this run has "
        f"{layout_text(here)}; only a reshardable checkpoint, trainer.reshardable_every / "
        "trainer.reshardable_at_end, resumes at another layout)"
    ]


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_resume(checkpoint_dir: Path, cfg: RunConfig) -> None:
    """Refuse a resume whose settings the checkpoint in `checkpoint_dir` cannot serve.

    A checkpoint whose meta.json cannot be read is left to the loader (which falls back to an
    older intact one and names the damage).

    Raises:
        ResumeIncompatibleError: naming every setting to restore, on one line.
    """
    try:
        meta = read_meta(checkpoint_dir)
    except CheckpointError:
        return
    problems = resume_incompatibilities(meta, cfg)
    if problems:
        raise ResumeIncompatibleError(
            f"--resume: {checkpoint_dir} cannot continue with this config; restore "
            + "; ".join(problems)
            + ", or start a new trainer.run_dir (model.hf_path may name an export of this checkpoint)"
        )
