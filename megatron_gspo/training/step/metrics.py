"""What a training step reports beside the loss: rollout statistics, memory, the bar's title."""

from __future__ import annotations

import torch

from megatron_gspo.config import RunConfig
from megatron_gspo.rollout import RolloutBatch


def peak_memory_metrics() -> dict[str, float]:
    """`perf/peak_memory_gib`: this rank's peak CUDA memory so far (none on CPU)."""
    if not torch.cuda.is_available():
        return {}
    return {"perf/peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def progress_label(cfg: RunConfig) -> str:
    """The progress bar's title: the loss, and the routing replay when one is on (e.g. GRPO+R2)."""
    replay = cfg.algorithm.routing_replay
    return cfg.algorithm.loss_type.upper() + ("" if replay == "none" else f"+{replay.upper()}")


def rollout_metrics(batch: RolloutBatch) -> dict[str, float]:
    """Reward and length statistics of a batch, the seconds spent scoring it and the task's metrics."""
    lengths = batch.response_lengths.float()
    return {
        "rollout/reward_mean": float(batch.rewards.mean()),
        "rollout/reward_std": float(batch.rewards.std()) if batch.batch_size > 1 else 0.0,
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/finish_stop_frac": sum(r == "stop" for r in batch.finish_reasons) / batch.batch_size,
        "rollout/dropped_groups": float(batch.stats.get("dropped_groups", 0)),
        "rollout/unparseable_samples": float(batch.stats.get("unparseable_samples", 0)),
        "rollout/no_answer_frac": float(batch.stats.get("no_answer_frac", 0.0)),
        "rollout/samples": float(batch.batch_size),
        "rollout/routed_experts_bytes": float(sum(r.nbytes for r in batch.routed_experts or ())),
        "time/reward_s": float(batch.stats.get("reward_s", 0.0)),
        **{key: float(value) for key, value in batch.stats.get("task_metrics", {}).items()},
    }
