"""`megatron-gspo train` end to end on the tiny MoE with the embedded rollout server.

One uninterrupted 4-step run with the KL loss on (checkpoints at steps 2 and 4, a NaN injected
into step 2's first mini-batch) is checked for its metrics records, and compared with a run killed
by SIGKILL after its step-2 checkpoint and resumed with --resume: the per-step metrics must be
identical, the KL to the reference model (reloaded from the run dir after SFT) included.
"""

import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from warm_python import python

from megatron_gspo.checkpoint.steps import latest_step
from megatron_gspo.training.metrics import read_metrics

pytestmark = pytest.mark.slow  # end-to-end training runs of 20-70 s each

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--config",
    str(REPO / "configs" / "tiny_moe_cpu.yaml"),
    "trainer.steps=4",
    "trainer.save_every=2",
    "sft.steps=30",
    "task.options.format_reward=0.5",  # partial credit, so a barely trained policy still gets signal
    "rollout.temperature=1.0",  # diverse groups: no all-zero-advantage step in these 4
    "eval.num_problems=20",
    "rollout.rollout_batch_size=8",
    "rollout.group_size=4",
    "algorithm.num_mini_batches=2",
    "debug.nan_loss_at_step=2",
    "logging.progress_bar=false",
    "algorithm.use_kl_loss=true",  # a reference model: the policy after SFT
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
REQUIRED = [
    "rollout/reward_mean",
    "rollout/response_length_mean",
    "rollout/logprob_mismatch_mean",
    "rollout/logprob_mismatch_max",
    "rollout/k3_kl",
    "advantages/zero_adv_group_frac",
    "actor/pg_loss",
    "actor/clipfrac_tokens",
    "actor/clipfrac_seq",
    "actor/clipfrac_seq_first_mb",
    "actor/clipfrac_seq_later_mbs",
    "actor/ratio_mean",
    "actor/ratio_min",
    "actor/ratio_max",
    "actor/entropy",
    "actor/kl_ref",
    "actor/kl_ref_first_mb",
    "actor/kl_loss",
    "train/grad_norm",
    "train/lr",
    "train/skipped_steps",
    "train/all_zero_adv_batch",
    "counters/skipped_steps",
    "perf/train_tokens_per_s",
    "perf/padding_frac",
    "perf/dp_token_imbalance",
    "time/rollout_s",
    "time/train_s",
    "time/sync_s",
    "time/step_s",
    "weight_version",
]
COMPARED = [
    "rollout/reward_mean",
    "actor/pg_loss",
    "train/grad_norm",
    "actor/ratio_mean",
    "eval/accuracy",
    "actor/kl_ref",  # equal only if the resumed run's reference gives the same log-probs, bit for bit
    "actor/kl_loss",
]


def train_cmd(run_dir, *extra):
    return [*python(), "-m", "megatron_gspo.cli", "train", *TINY, f"trainer.run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    done = subprocess.run(train_cmd(run_dir), env=ENV, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    return run_dir, done


def test_metrics_records(reference):
    run_dir, done = reference
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert 0.0 <= records[0]["eval/accuracy"] <= 1.0 and records[0]["weight_version"] == 0
    for r in records[1:]:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        assert r["weight_version"] == r["step"]
        assert r["train/all_zero_adv_batch"] == 0.0
    assert "eval/accuracy" in records[4]
    # The NaN injected into step 2's first mini-batch skipped that optimizer step only.
    assert [r["train/skipped_steps"] for r in records[1:]] == [0, 1, 0, 0]
    assert [r["counters/skipped_steps"] for r in records[1:]] == [0, 1, 1, 1]
    assert records[2]["train/optimizer_steps"] == 1
    # Before any update the trainer reproduces the rollout engine's log-probs (same weights).
    assert records[1]["rollout/logprob_mismatch_max"] < 1e-3
    # The policy is the reference until its first optimizer step; then they part.
    assert records[1]["actor/kl_ref_first_mb"] == 0.0
    assert all(r["actor/kl_ref"] > 0 for r in records[2:]) and records[4]["actor/kl_ref_first_mb"] > 0
    assert any(Path(run_dir, "tensorboard").iterdir())
    assert latest_step(run_dir / "checkpoints") == 4
    assert "held-out accuracy" in done.stdout


def test_kill_and_resume_reproduces_the_uninterrupted_run(reference, tmp_path):
    ref_dir, _ = reference
    run_dir = tmp_path / "killed"
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen(train_cmd(run_dir), env=ENV, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        while latest_step(run_dir / "checkpoints") is None:
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint written in time"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer and the rollout server it started
        proc.wait()
    assert latest_step(run_dir / "checkpoints") == 2
    done = subprocess.run(
        train_cmd(run_dir, "--resume"), env=ENV, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stderr[-4000:]
    resumed = read_metrics(run_dir / "metrics.jsonl")
    expected = read_metrics(ref_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in expected]
    for got, want in zip(resumed, expected):
        for key in COMPARED:
            assert got.get(key) == want.get(key), (
                f"step {got['step']} {key}: {got.get(key)} != {want.get(key)}"
            )


def test_a_fresh_run_refuses_a_run_dir_with_checkpoints_before_doing_any_work(reference):
    run_dir, _ = reference
    before = (run_dir / "metrics.jsonl").read_text()
    done = subprocess.run(train_cmd(run_dir), env=ENV, capture_output=True, text=True, timeout=400)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "already holds checkpoints up to step 4: pass --resume" in done.stderr
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing of the finished run touched
    assert "SFT step" not in done.stderr + done.stdout  # refused at start-up, before any training


@pytest.mark.parametrize("bf16_side", ["rollout.dtype=bf16", "engine.dtype=bf16"], ids=["server", "trainer"])
def test_bf16_on_one_side_shows_as_train_inference_mismatch(reference, tmp_path, bf16_side):
    """Step 1 scores the rollout weights: fp32 on both sides agree to ~1e-7 nats per token; a bf16
    server (bf16 logits) or a bf16 trainer (megatron mixed precision) differs by bf16 rounding,
    measured mean ~3e-3 and max ~1e-2 (u = 2^-8 on logits of a few nats); a wrong model or
    mis-aligned tokens would be O(1)."""
    ref_dir, _ = reference
    run_dir = tmp_path / "bf16"
    done = subprocess.run(
        train_cmd(run_dir, "trainer.steps=1", bf16_side), env=ENV, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stderr[-4000:]
    step1 = read_metrics(run_dir / "metrics.jsonl")[1]
    fp32_step1 = read_metrics(ref_dir / "metrics.jsonl")[1]
    assert fp32_step1["rollout/logprob_mismatch_mean"] < 1e-6
    assert 1e-3 < step1["rollout/logprob_mismatch_mean"] < 0.05
    assert step1["rollout/logprob_mismatch_max"] < 0.5
    assert step1["train/skipped_steps"] == 0 and math.isfinite(step1["actor/pg_loss"])


def test_resume_of_a_checkpoint_saved_before_any_update(tmp_path):
    """20 SFT steps leave the policy too weak for any reward: every RL step so far was skipped
    (all-zero advantages) when the checkpoints were written. Resuming continues as the
    uninterrupted run does (same rollouts, from the restored data position and RNG streams)."""
    weak = [
        "--config",
        str(REPO / "configs" / "tiny_moe_cpu.yaml"),
        "sft.steps=20",
        "trainer.save_every=1",
        "eval.num_problems=20",
        "logging.progress_bar=false",
    ]

    def train(run_dir, steps, *extra):
        cmd = [*python(), "-m", "megatron_gspo.cli", "train", *weak, f"trainer.steps={steps}"]
        done = subprocess.run([*cmd, f"trainer.run_dir={run_dir}", *extra], env=ENV, capture_output=True,
                              text=True, timeout=400)  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        return read_metrics(run_dir / "metrics.jsonl")

    stopped = train(tmp_path / "stopped", 2)
    assert [r["counters/all_zero_adv_batches"] for r in stopped[1:]] == [1.0, 2.0]  # nothing updated
    resumed = train(tmp_path / "stopped", 4, "--resume")
    uninterrupted = train(tmp_path / "uninterrupted", 4)
    assert [r["step"] for r in resumed] == [r["step"] for r in uninterrupted] == [0, 1, 2, 3, 4]
    for got, want in zip(resumed[3:], uninterrupted[3:]):
        for key in ("rollout/response_length_mean", "rollout/response_length_max", "counters/skipped_steps"):
            assert got[key] == want[key], (got["step"], key)
