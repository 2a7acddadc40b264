"""Per-step metrics: one JSON line per step (metrics.jsonl), TensorBoard, W&B, a progress bar.

Only global rank 0 writes; W&B only when `logging.wandb.project` is set. Non-finite values are
written as JSON null. On resume, lines of steps after the checkpoint (written by the interrupted
run) are dropped, so the file reads like one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import secrets
from pathlib import Path
from typing import Any

from tqdm import tqdm

# Key numbers shown on the progress bar: metric key -> short label.
PROGRESS_KEYS = {
    "rollout/reward_mean": "reward",
    "eval/accuracy": "acc",
    "actor/clipfrac_seq": "clip",
    "train/grad_norm": "gnorm",
    "time/step_s": "s/step",
}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


WANDB_ID_FILE = "wandb_run_id"


def start_wandb(run_dir: str | Path, settings, run_config: dict[str, Any] | None = None):
    """A W&B run for `run_dir` (`settings`: a `config.WandbConfig` with `project` set).

    The run id is kept in `run_dir/wandb_run_id`, so a resumed training run continues its W&B
    run (W&B ignores steps at or below the last one it has, i.e. those re-run after a crash).
    Files go under `run_dir/wandb` (the offline mode writes only there, with no network).
    """
    import wandb

    id_file = Path(run_dir, WANDB_ID_FILE)
    run_id = id_file.read_text().strip() if id_file.is_file() else None
    if not run_id:
        run_id = secrets.token_hex(4)  # W&B ids: lowercase letters and digits
        id_file.write_text(run_id + "\n")
    return wandb.init(
        project=settings.project,
        entity=settings.entity,
        name=settings.name or Path(run_dir).name,
        tags=list(settings.tags) or None,
        mode=settings.mode,
        dir=str(run_dir),
        id=run_id,
        resume="allow",
        config=run_config,
    )


class MetricsLogger:
    """Writes step records; a no-op on ranks other than 0.

    Args:
        run_dir: directory of metrics.jsonl and tensorboard/.
        total_steps: for the progress bar.
        first_step: the step the run starts at (records of later steps already on disk are dropped).
        enabled: whether this process writes (global rank 0).
        tensorboard: write TensorBoard event files.
        progress_bar: show tqdm.
        label: the progress bar's title (the loss and replay, e.g. "GRPO+R2").
        wandb: a `config.WandbConfig`; with its `project` set, the records also go to W&B.
        run_config: the run's config as a dict, recorded with the W&B run.
    """

    def __init__(self, run_dir: str | Path, *, total_steps: int, first_step: int = 0, enabled: bool = True,
                 tensorboard: bool = True, progress_bar: bool = True, label: str = "RL", wandb=None,
                 run_config: dict[str, Any] | None = None):  # fmt: skip
        self.enabled = enabled
        self.path = Path(run_dir, "metrics.jsonl")
        self._writer = None
        self._wandb = None
        self._bar = None
        self.last: dict[str, Any] = {}
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", -1) < first_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(Path(run_dir, "tensorboard")), purge_step=first_step)
        if wandb is not None and wandb.project is not None:
            self._wandb = start_wandb(run_dir, wandb, run_config)
        if progress_bar:
            # Step 0 is the cold-start record, not an RL step: the bar counts steps 1..total.
            done = max(first_step - 1, 0)
            self._bar = tqdm(total=total_steps, initial=done, desc=label, dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one step's record and update TensorBoard and the bar."""
        if not self.enabled:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.last = record
        scalars = {key: value for key, value in metrics.items() if _is_number(value)}
        if self._writer is not None:
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._bar is not None:
            shown = {
                label: f"{metrics[k]:.3g}" for k, label in PROGRESS_KEYS.items() if _is_number(metrics.get(k))
            }
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1 if step > 0 else 0)

    def close(self) -> None:
        """Flush and close the writers."""
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._bar is not None:
            self._bar.close()


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
