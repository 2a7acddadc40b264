"""Per-step metrics: one JSON line per step (metrics.jsonl), TensorBoard scalars and a progress bar.

Only global rank 0 writes. Non-finite values are written as JSON null. On resume, lines of
steps after the checkpoint (written by the interrupted run) are dropped, so the file reads
like one uninterrupted run.
"""

from __future__ import annotations

import json
import math
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
    """

    def __init__(self, run_dir: str | Path, *, total_steps: int, first_step: int = 0, enabled: bool = True,
                 tensorboard: bool = True, progress_bar: bool = True, label: str = "RL"):  # fmt: skip
        self.enabled = enabled
        self.path = Path(run_dir, "metrics.jsonl")
        self._writer = None
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
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()
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
        if self._bar is not None:
            self._bar.close()


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
