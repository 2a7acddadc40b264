"""`megatron-gspo train` of the tiny demo with real SGLang servers (rollout.engine=sglang): what the
end-to-end tests against SGLang share. A 30-step cold start whose rewards are mixed, so steps train."""

import os
import subprocess
from pathlib import Path

from warm_python import python

from megatron_gspo.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
TINY_SGLANG_RUN = [
    "--config",
    str(REPO / "configs" / "tiny_moe_cpu.yaml"),
    "rollout.engine=sglang",
    "trainer.steps=3",
    "sft.steps=30",
    "task.options.format_reward=0.5",
    "eval.num_problems=10",
    "rollout.rollout_batch_size=8",
    "rollout.group_size=4",
    "algorithm.num_mini_batches=2",
    "logging.progress_bar=false",
    "trainer.seed=1234",
]


def train_with_sglang(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The run, to its end (asserted), with `overrides` after the shared ones."""
    done = subprocess.run(
        [
            *python(),
            "-m",
            "megatron_gspo.cli",
            "train",
            *TINY_SGLANG_RUN,
            *overrides,
            f"trainer.run_dir={run_dir}",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def rl_steps(run_dir: Path) -> list[dict]:
    """The metrics rows of the RL steps (step 0 is the cold start)."""
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]
