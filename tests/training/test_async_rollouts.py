"""rollout.max_staleness end to end: the CPU demo trains with rollouts one version ahead.

A 4-step run at k = 1 whose step-2 sync skips a version (`debug.version_gap_at_step=2`): the
batch generated at version 1 meets trainer version 3 and must be dropped, never trained; then
a resume, which starts with an empty queue.
Staleness is read from the versions the rollout server reported for the trained samples.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.config import ConfigError, RunConfig, validate
from megatron_gspo.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_max_staleness_refuses_a_negative_bound_and_r3_by_name():
    cfg = RunConfig()
    cfg.rollout.max_staleness = -1
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=-1: must be >= 0"):
        validate(cfg)
    cfg.rollout.max_staleness = 1
    cfg.algorithm.routing_replay = "r3"
    with pytest.raises(ConfigError, match=r"routing_replay=r3 with rollout.max_staleness=1"):
        validate(cfg)


@pytest.mark.slow  # one end-to-end run, ~40 s on a loaded 2-core box
def test_staleness_one_trains_within_the_bound_and_drops_an_older_batch(tmp_path):
    cmd = [
        sys.executable, "-m", "megatron_gspo.cli", "train",
        "--config", str(REPO / "configs" / "tiny_moe_cpu.yaml"),
        "trainer.steps=4", "sft.steps=30", "eval.num_problems=20",
        "task.options.format_reward=0.5", "rollout.temperature=1.0",
        "rollout.rollout_batch_size=8", "rollout.group_size=4", "algorithm.num_mini_batches=2",
        "logging.progress_bar=false", f"trainer.run_dir={tmp_path}",
        "rollout.max_staleness=1", "debug.version_gap_at_step=2",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = read_metrics(tmp_path / "metrics.jsonl")[1:]
    # versions before each step's sync: 0, 1, 3 (step 2 skipped one), 4
    assert [r["weight_version"] for r in steps] == [1, 3, 4, 5]
    # step 1: the first batch (v0 at v0); 2: made during step 1 (v0 at v1); 3: the v1 batch is
    # 2 versions old at v3, dropped (8 groups), a fresh v3 batch trained; 4: v3 at v4.
    assert [r["rollout/staleness_max"] for r in steps] == [0, 1, 0, 1]
    assert [r["rollout/staleness_mean"] for r in steps] == [0, 1, 0, 1]
    assert [r["rollout/stale_groups_dropped"] for r in steps] == [0, 0, 8, 0]
    assert all(r["rollout/samples"] == 32 and r["train/optimizer_steps"] == 2 for r in steps)
    assert all(0 <= r["perf/overlap"] <= 1 and r["time/wait_rollout_s"] >= 0 for r in steps)
    # Resume (the queue starts empty): step 5's batch is fresh, step 6's was made during step 5.
    resumed = subprocess.run(
        [*cmd, "trainer.steps=6", "--resume"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    steps = read_metrics(tmp_path / "metrics.jsonl")[1:]
    assert [r["step"] for r in steps[-2:]] == [5, 6]
    assert [r["rollout/staleness_max"] for r in steps[-2:]] == [0, 1]
    assert [r["weight_version"] for r in steps[-2:]] == [6, 7]
