"""Per-step metrics: one JSON line per step (metrics.jsonl), TensorBoard, W&B, a progress bar.

Only global rank 0 writes; W&B only when `logging.wandb.project` is set. Non-finite values are
written as JSON null. On resume, lines of steps after the checkpoint (written by the interrupted
run) are dropped, so the file reads like one uninterrupted run. The same holds for samples.jsonl:
a few (prompt, completion, reward) rows per step, also shown as TensorBoard text
(`logging.samples_per_step`).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from pathlib import Path
from typing import Any

from tqdm import tqdm

from megatron_gspo.errors import ConfigError
from megatron_gspo.optional import require

logger = logging.getLogger(__name__)

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


def read_metrics(path: str | Path, *, drop_torn_tail: bool = False) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file (or samples.jsonl).

    Args:
        path: the file.
        drop_torn_tail: skip, with a warning, a last line that is not JSON: a run killed while
            appending a record leaves it torn (a resume re-runs that step).

    Raises:
        ValueError: naming the line (1-based) that is not a JSON record.
    """
    lines = Path(path).read_text().splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if drop_torn_tail and i == last:
                logger.warning("%s line %d is torn (a run stopped while writing it): dropped", path, i + 1)
                continue
            raise ValueError(f"{path} line {i + 1} is not a JSON record ({err.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path} line {i + 1} is not a JSON record (an object)")
        records.append(record)
    return records


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
        self.samples_path = Path(run_dir, "samples.jsonl")
        self._writer = None
        self._wandb = None
        self._bar = None
        self.last: dict[str, Any] = {}
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for path in (self.path, self.samples_path):
            if path.exists():
                try:
                    records = read_metrics(path, drop_torn_tail=True)
                except ValueError as err:  # a damaged record before the last: the user's to fix
                    raise ConfigError(f"{err}; repair or delete that line, then resume") from None
                kept = [r for r in records if r.get("step", -1) < first_step]
                path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        if tensorboard:
            require("tensorboard", "logging.tensorboard=true")
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

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Append a step's rows (prompt, answer, completion, reward) to samples.jsonl and TensorBoard."""
        if not self.enabled or not rows:
            return
        with self.samples_path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")
        if self._writer is not None:
            text = "\n\n".join(
                f"**reward {row['reward']:g}** (answer `{row['answer']}`)\n\n"
                f"```\n{row['prompt']}\n```\n\n```\n{row['completion']}\n```"
                for row in rows
            )
            self._writer.add_text("samples", text, step)
            self._writer.flush()

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


class ZeroRewardWatch:
    """Warns loudly when the rollout reward is exactly 0 for `steps` steps in a row (0: never).

    A run on zero reward has nothing to learn from and still exits 0; the usual causes are a
    reward that cannot read the answers (look at `rollout/no_answer_frac` and samples.jsonl) or
    a policy too weak for the task. The warning repeats every `steps` zero steps.
    """

    def __init__(self, steps: int, samples_per_step: int = 0):
        self.steps, self.run = steps, 0
        self.samples_per_step = samples_per_step

    def update(self, step: int, metrics: dict[str, Any]) -> bool:
        """Count this step's reward; True (and a warning logged) when the zero run reaches k x `steps`."""
        reward = metrics.get("rollout/reward_mean")
        self.run = self.run + 1 if reward == 0.0 else 0
        if not self.steps or not self.run or self.run % self.steps:
            return False
        no_answer = metrics.get("rollout/no_answer_frac")
        logger.warning(
            "!!! step %d: the rollout reward has been exactly 0 for %d steps in a row: nothing is being "
            "learned. %s %s to see what the model writes and what the reward expects "
            "(logging.zero_reward_warn_steps sets this check).",
            step,
            self.run,
            f"{no_answer:.0%} of the completions have no answer the reward can extract."
            if isinstance(no_answer, float)
            else "",
            "Look at run_dir/samples.jsonl"
            if self.samples_per_step > 0
            else "Set logging.samples_per_step (e.g. 4) and look at run_dir/samples.jsonl",
        )
        return True
