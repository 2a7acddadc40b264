"""rollout.max_staleness end to end: the CPU demo trains with rollouts one version ahead.

A 4-step run at k = 1 whose step-2 sync skips a version (`debug.version_gap_at_step=2`): the
batch generated at version 1 meets trainer version 3 and must be dropped, never trained; then
a resume, which starts with an empty queue.
Staleness is read from the versions the rollout server reported for the trained samples.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
from warm_python import python

from megatron_gspo.config import ConfigError, RunConfig, validate
from megatron_gspo.rollout.server.main import HOLD_DECODE_ENV
from megatron_gspo.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_max_staleness_refuses_a_negative_bound_and_takes_r3():
    cfg = RunConfig()
    cfg.rollout.max_staleness = -1
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=-1: must be >= 0"):
        validate(cfg)
    cfg.rollout.max_staleness = 1
    cfg.algorithm.routing_replay = "r3"  # replays the behaviour policy's routes, however old
    validate(cfg)


@pytest.mark.slow  # one end-to-end run, ~40 s on a loaded 2-core box
def test_staleness_one_trains_within_the_bound_and_drops_an_older_batch(tmp_path):
    cmd = [
        *python(), "-m", "megatron_gspo.cli", "train",
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
    # Batches generated: 4 trained + the dropped v1 one; none starts once the 4th is taken (the
    # run's batch count caps the producer: a 6th would be generated for nobody).
    assert "rollouts ahead: 5 batch(es) started, 4 taken, 1 dropped as stale" in done.stderr
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
    assert "rollouts ahead: 2 batch(es) started, 2 taken, 0 dropped as stale" in resumed.stderr


def test_update_mode_keys_are_validated_by_name():
    cfg = RunConfig()
    cfg.rollout.update_mode = "partial"
    with pytest.raises(ConfigError, match=r"rollout.update_mode=partial needs rollout.max_staleness >= 1"):
        validate(cfg)
    cfg.rollout.update_mode, cfg.rollout.max_staleness = "pause", 1
    cfg.rollout.mask_stale_segments = True
    with pytest.raises(ConfigError, match=r"mask_stale_segments=true needs rollout.update_mode=partial"):
        validate(cfg)
    cfg.rollout.update_mode = "partial"
    validate(cfg)


@pytest.mark.slow  # one end-to-end run, ~30 s on a loaded 2-core box
def test_partial_rollouts_cut_by_every_sync_train_within_the_bound(tmp_path):
    """k = 2, update_mode=partial, R3 and drift, every sync lands mid-batch: read from samples.jsonl.

    The server's test-only hold keeps each batch generating through the next sync: once a batch's
    16 responses have ended under the weights served, the next batch decodes one token and waits
    for the sync's pause.
    With k = 2 the producer starts batch s + 1 as soon as batch s is done, and the trainer syncs
    after training step s, so every step from 2 on trains on responses that sync cut, after their
    first token (step 1's batch is generated before any sync). Each such response is made of
    contiguous segments of increasing versions within the bound, and its routes (merged over the
    segments) cover every position.
    """
    k, steps = 2, 3
    cmd = [
        *python(), "-m", "megatron_gspo.cli", "train",
        "--config", str(REPO / "configs" / "tiny_moe_cpu.yaml"),
        f"trainer.steps={steps}", "sft.steps=30", "eval.every=0", "eval.at_start=false", "eval.at_end=false",
        "task.options.format_reward=0.5", "rollout.temperature=1.0", "rollout.max_new_tokens=8",
        "rollout.rollout_batch_size=4", "rollout.group_size=4", "algorithm.num_mini_batches=1",
        "logging.progress_bar=false", "logging.samples_per_step=16", f"trainer.run_dir={tmp_path}",
        f"rollout.max_staleness={k}", "rollout.update_mode=partial",
        "algorithm.routing_replay=r3", "drift.enabled=true", "drift.every=1",
    ]  # fmt: skip
    # a batch is 16 responses (rollout_batch_size x group_size), generated as one engine batch, so
    # the launch's /health generation does not let the hold start inside step 1's batch
    env = {**ENV, HOLD_DECODE_ENV: "16"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    records = read_metrics(tmp_path / "metrics.jsonl")[1:]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    trainer_version = {r["step"]: int(r["weight_version"]) - 1 for r in records}  # before the step's sync
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert all(sum(1 for r in rows if r["step"] == s) == 16 for s in range(1, steps + 1))
    cut = {s: 0 for s in range(1, steps + 1)}
    for row in rows:
        segments = row["segments"]
        assert segments and segments[0]["start"] == 0
        assert all(a["start"] + a["length"] == b["start"] for a, b in zip(segments, segments[1:]))
        assert sum(s["length"] for s in segments) == row["response_tokens"]
        v = trainer_version[row["step"]]
        versions = [int(s["weight_version"]) for s in segments]
        assert all(v - k <= version <= v for version in versions), (row["step"], versions)
        assert all(a < b for a, b in zip(versions, versions[1:])), versions  # a cut is a sync
        assert row["routed_positions"] == row["prompt_tokens"] + row["response_tokens"] - 1
        cut[row["step"]] += len(segments) > 1
    assert cut[1] == 0 and all(cut[s] > 0 for s in range(2, steps + 1)), cut
    assert all(0 <= r["rollout/staleness_max"] <= k for r in records)
    assert all(r["rollout/segments_mean"] > 1 for r in records[1:])
    assert all(r["sync/cache_flushed"] == 1 for r in records)  # the cut requests left before the flush
    # behaviour -> current routing drift: the engine's routes (older versions) vs pi_old's
    assert all(0 <= r["drift/infer_train/mean"] <= 1 for r in records)
