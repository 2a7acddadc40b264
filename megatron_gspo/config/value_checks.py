"""Start-up checks of single values in a `RunConfig`, before any heavy work.

`validate` (`config.validate`) checks what spans several fields; this module checks what each value
must be on its own: finite floats everywhere, positive sizes and timeouts, http(s) server URLs,
and sizes so large they cannot be meant (refused with the limit and why). Each error names
the field as `section.key`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from megatron_gspo.model.config import MoEModelConfig

if TYPE_CHECKING:
    from megatron_gspo.config.schema import RolloutConfig

# Beyond these a value is a typo, not a plan: the largest public MoE models stay far below them.
MODEL_LIMITS = {
    "vocab_size": 2_000_000,
    "hidden_size": 65_536,
    "num_layers": 1_024,
    "num_attention_heads": 1_024,
    "num_query_groups": 1_024,
    "head_dim": 1_024,
    "num_experts": 4_096,
    "moe_topk": 256,
    "moe_ffn_hidden_size": 262_144,
    "max_position_embeddings": 4_194_304,
}
# Responses per RL step and held-out problems: past these, rank 0 would hold the batch in host memory.
MAX_RESPONSES_PER_STEP = 1_048_576
MAX_EVAL_PROBLEMS = 1_000_000
MAX_EVAL_SAMPLES = 1024  # answers per held-out problem for pass@k


class ValueCheckError(ValueError):
    """A single config value is out of range (the config module turns it into a ConfigError)."""


def _walk(obj: Any, prefix: str = ""):
    """(dotted name, value) of every leaf of nested dataclasses, dicts and lists."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name), f"{prefix}{f.name}.")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, f"{prefix}{key}.")
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _walk(value, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), obj


def check_finite(cfg: Any) -> None:
    """Refuse NaN / inf anywhere in the config tree."""
    for name, value in _walk(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueCheckError(f"{name}={value}: every number in the config must be finite")


def check_rollout(rollout: Any) -> None:
    """Sampling, retry, timeout, thread, dtype and server-URL values of `rollout`."""
    if rollout.top_k == 0 or rollout.top_k < -1:
        raise ValueCheckError(f"rollout.top_k={rollout.top_k}: use -1 (off) or a positive k")
    if rollout.max_retries < 0:
        raise ValueCheckError(f"rollout.max_retries must be >= 0, got {rollout.max_retries}")
    for name in ("request_timeout_s", "batch_timeout_s", "server_start_timeout_s"):
        if getattr(rollout, name) <= 0:
            raise ValueCheckError(f"rollout.{name} must be > 0 seconds, got {getattr(rollout, name)}")
    if rollout.server_threads < 1:
        raise ValueCheckError(f"rollout.server_threads must be >= 1, got {rollout.server_threads}")
    check_router(rollout)
    check_engine(rollout)
    if (rollout.server_urls or rollout.router_url) and rollout.dtype != "fp32":
        raise ValueCheckError(
            f"rollout.dtype={rollout.dtype} sets the embedded server's dtype; the SGLang servers in "
            "rollout.server_urls run with their own --dtype: remove rollout.dtype"
        )
    for url in rollout.server_urls:
        parts = urlsplit(str(url))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueCheckError(
                f"rollout.server_urls: {url!r} is not an http(s) URL such as http://10.0.0.5:30000"
            )
    responses = rollout.rollout_batch_size * rollout.group_size
    if responses > MAX_RESPONSES_PER_STEP:
        raise ValueCheckError(
            f"rollout.rollout_batch_size x group_size = {responses} responses per step exceeds "
            f"{MAX_RESPONSES_PER_STEP}: rank 0 holds a step's batch in host memory"
        )


def check_engine(rollout: Any) -> None:
    """rollout.engine=sglang: servers the run starts itself, in a layout it can start them in."""
    if rollout.engine != "sglang":
        return
    if rollout.server_urls or rollout.router_url:
        raise ValueCheckError(
            "rollout.engine=sglang starts the run's own SGLang servers, but rollout.server_urls / "
            "router_url name running ones: remove one of them"
        )
    if rollout.sglang_max_total_tokens < 1:
        raise ValueCheckError(
            f"rollout.sglang_max_total_tokens must be >= 1, got {rollout.sglang_max_total_tokens}"
        )
    if rollout.quantization != "none":
        raise ValueCheckError(
            f"rollout.engine=sglang serves the trainer's checkpoint as it is; rollout.quantization="
            f"{rollout.quantization} needs servers launched from a block-FP8 checkpoint "
            "(launch/sglang_servers.sh, rollout.server_checkpoint)"
        )


def check_router(rollout: Any) -> None:
    """rollout.router_url: an http(s) URL, not beside server_urls; the fleet's sizes."""
    if rollout.router_url is not None:
        if rollout.server_urls:
            raise ValueCheckError(
                "rollout.router_url and rollout.server_urls both set: the router lists its workers "
                "itself; keep one of them"
            )
        parts = urlsplit(str(rollout.router_url))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueCheckError(
                f"rollout.router_url: {rollout.router_url!r} is not an http(s) URL such as http://10.0.0.5:30000"
            )
    if rollout.min_workers < 1:
        raise ValueCheckError(f"rollout.min_workers must be >= 1, got {rollout.min_workers}")
    if rollout.router_max_in_flight < 1:
        raise ValueCheckError(
            f"rollout.router_max_in_flight must be >= 1, got {rollout.router_max_in_flight}"
        )


def check_weight_sync(sync: Any, rollout: Any) -> None:
    """weight_sync.*: sizes, timeouts, and a method the configured servers can take."""
    if sync.bucket_mb <= 0:
        raise ValueCheckError(f"weight_sync.bucket_mb must be > 0, got {sync.bucket_mb}")
    if sync.timeout_s <= 0:
        raise ValueCheckError(f"weight_sync.timeout_s must be > 0 seconds, got {sync.timeout_s}")
    if sync.release_timeout_s <= 0:
        raise ValueCheckError(
            f"weight_sync.release_timeout_s must be > 0 seconds, got {sync.release_timeout_s}"
        )
    if sync.retries < 0:
        raise ValueCheckError(f"weight_sync.retries must be >= 0, got {sync.retries}")
    if not 0 <= sync.master_port <= 65535:
        raise ValueCheckError(f"weight_sync.master_port={sync.master_port} is not a port (0: any free port)")
    colocated = getattr(rollout, "placement", "disaggregated") == "colocated"
    if sync.method == "tensor" and (rollout.server_urls or rollout.router_url) and not colocated:
        raise ValueCheckError(
            "weight_sync.method=tensor hands the servers handles to the trainer's memory (CUDA IPC on "
            "GPU, shared memory on CPU), which only servers on the trainer's own GPUs can open "
            "(rollout.placement=colocated): use distributed for servers elsewhere"
        )
    if rollout.quantization == "fp8" and sync.method == "disk":
        raise ValueCheckError(
            "rollout.quantization=fp8 quantises the weights as they stream to the servers; "
            "weight_sync.method=disk writes a bf16 checkpoint: use distributed (or tensor)"
        )


def check_model_sizes(model: MoEModelConfig) -> None:
    """Every architecture size positive and below `MODEL_LIMITS`."""
    for name, limit in MODEL_LIMITS.items():
        value = getattr(model, name)
        if value < 1:
            raise ValueCheckError(f"model {name}={value} must be >= 1")
        if value > limit:
            raise ValueCheckError(f"model {name}={value} exceeds {limit}, larger than any model this trains")
    if model.moe_topk > model.num_experts:
        raise ValueCheckError(f"model moe_topk={model.moe_topk} exceeds num_experts={model.num_experts}")


def check_eval(eval_cfg: Any) -> None:
    """Held-out evaluation size, and pass@k's samples, temperature and k."""
    if eval_cfg.num_problems > MAX_EVAL_PROBLEMS:
        raise ValueCheckError(
            f"eval.num_problems={eval_cfg.num_problems} exceeds {MAX_EVAL_PROBLEMS} "
            "(every evaluation generates a greedy answer for each)"
        )
    n = eval_cfg.samples_per_problem
    if not 0 <= n <= MAX_EVAL_SAMPLES:
        raise ValueCheckError(
            f"eval.samples_per_problem={n} must be in [0, {MAX_EVAL_SAMPLES}] (0: greedy only)"
        )
    if eval_cfg.pass_k and n == 0:
        raise ValueCheckError(
            f"eval.pass_k={list(eval_cfg.pass_k)} needs eval.samples_per_problem > 0 (pass@k samples answers)"
        )
    bad = [k for k in eval_cfg.pass_k if not 1 <= k <= n]
    if bad:
        raise ValueCheckError(
            f"eval.pass_k={list(eval_cfg.pass_k)}: each k must be in [1, {n}] (samples_per_problem)"
        )
    if n and not eval_cfg.temperature > 0:
        raise ValueCheckError(
            f"eval.temperature={eval_cfg.temperature} must be > 0 for sampled pass@k "
            "(greedy pass@1 is eval/accuracy)"
        )


def check_run_dir_writable(run_dir: str | os.PathLike) -> None:
    """Create `run_dir` and write a probe file in it, so an unwritable dir fails before any training."""
    path = Path(run_dir)
    probe = path / f".write-probe-{uuid.uuid4().hex}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueCheckError(f"trainer.run_dir={run_dir} cannot be written: {err.strerror or err}") from None


CONTROL_MARGIN_S = 600.0
"""What a rollout batch must leave of the control group's timeout: rank 0 scores the batch and
computes advantages before the waiting ranks hear from it."""


def check_rollout_timeouts(rollout: RolloutConfig, timeout_minutes: float) -> None:
    """The rollout timeouts fit each other and the control group's `parallel.timeout_minutes`."""
    if rollout.request_timeout_s > rollout.batch_timeout_s:
        raise ValueCheckError(
            f"rollout.request_timeout_s={rollout.request_timeout_s:g} exceeds rollout.batch_timeout_s="
            f"{rollout.batch_timeout_s:g}: the batch cap cuts a generation off before it can time out "
            "and be retried; lower rollout.request_timeout_s or raise rollout.batch_timeout_s"
        )
    allowed = timeout_minutes * 60 - CONTROL_MARGIN_S
    if rollout.batch_timeout_s > allowed:
        needed = math.ceil((rollout.batch_timeout_s + CONTROL_MARGIN_S) / 60)
        raise ValueCheckError(
            f"rollout.batch_timeout_s={rollout.batch_timeout_s:g} s: the other ranks wait that long for "
            f"rank 0's rollouts on the control group, which parallel.timeout_minutes={timeout_minutes:g} "
            f"aborts first ({CONTROL_MARGIN_S:g} s must be left for scoring); raise "
            f"parallel.timeout_minutes to >= {needed} or lower rollout.batch_timeout_s to <= {allowed:g}"
        )
