"""`megatron-gspo train` with GRPO + Routing Replay (R2, R3) and drift metrics on the tiny MoE."""

import os
import subprocess
from pathlib import Path

import pytest
from warm_python import python

from megatron_gspo.training.metrics import read_metrics

pytestmark = pytest.mark.slow  # end-to-end training runs of 20-40 s each

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--config",
    str(REPO / "configs" / "tiny_moe_cpu.yaml"),
    "trainer.steps=2",
    "sft.steps=30",
    "task.options.format_reward=0.5",
    "eval.num_problems=10",
    "rollout.rollout_batch_size=8",
    "rollout.group_size=4",
    "algorithm.num_mini_batches=2",
    "logging.progress_bar=false",
    "algorithm.loss_type=grpo",
    "algorithm.loss_options={}",
    "drift.enabled=true",
    "trainer.seed=1234",  # a seed whose 30-step cold start gives mixed rewards, so steps train
]


@pytest.mark.parametrize(
    "mode,extra",
    [
        ("r2", []),
        ("r3", []),
        # Token-budget micro-batches (rows of 5..11 tokens, budget 24): the routed experts follow
        # the rows into micro-batches of different sizes.
        ("r3", ["trainer.max_tokens_per_micro_batch=24"]),
    ],
)
def test_grpo_with_routing_replay_logs_per_layer_drift(tmp_path, mode, extra):
    cmd = [
        *python(),
        "-m",
        "megatron_gspo.cli",
        "train",
        *TINY,
        f"algorithm.routing_replay={mode}",
        *extra,
    ]
    done = subprocess.run(
        [*cmd, f"trainer.run_dir={tmp_path}"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    trained = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] > 0]
    trained = [r for r in trained if r["train/all_zero_adv_batch"] == 0.0]
    assert trained, "no step trained"
    for record in trained:
        assert record["routing/replay_bytes_per_token"] == 2 * 2  # 2 layers x top-2 x uint8
        for prefix in ("drift/old_new", "drift/infer_train"):
            layers = [record[f"{prefix}/layer_{i}"] for i in range(2)]
            assert all(0.0 <= v <= 1.0 for v in layers)
            assert record[f"{prefix}/mean"] == pytest.approx(sum(layers) / 2)
            assert 0.0 <= record[f"{prefix}/tokens_changed"] <= 1.0
        # Mini-batch 0 runs on the rollout weights: the router's choice equals pi_old's.
        assert record["drift/old_new_mb0/mean"] == 0.0
        # Same weights, fp32 on both sides: inference and training routing agree away from ties.
        assert record["drift/infer_train/mean"] <= 0.02


def test_drift_every_n_steps(tmp_path):
    """drift.every=2: steps 1 and 3 measure drift (extra pi_old forward), step 2 does not.

    Nor does step 2 ask the server for routed experts: its rollouts carry none (0 bytes received).
    """
    args = [a for a in TINY if a != "trainer.steps=2"] + ["trainer.steps=3", "drift.every=2"]
    args += ["algorithm.loss_type=gspo", "drift.sample_tokens=64"]
    args = [a for a in args if a != "algorithm.loss_options={}"]
    done = subprocess.run(
        [*python(), "-m", "megatron_gspo.cli", "train", *args, f"trainer.run_dir={tmp_path}"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = {r["step"]: r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] > 0}
    trained = {s for s, r in records.items() if r["train/all_zero_adv_batch"] == 0.0}
    assert trained & {1, 3}, "no measured step trained"
    received = {s: r["rollout/routed_experts_bytes"] for s, r in records.items()}
    # Rows of 5..11 tokens x 2 layers x top-2, one uint8 id each.
    assert received[2] == 0 and all(2 * 2 * 5 * 32 <= received[s] for s in (1, 3)), received
    for step in trained:
        measured = any(k.startswith("drift/") for k in records[step])
        assert measured == (step in (1, 3)), (step, sorted(records[step]))
