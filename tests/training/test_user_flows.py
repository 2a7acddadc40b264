"""Flows a user meets around a run directory: `train --resume`, `export --out`.

`train --resume`: settings a checkpoint cannot serve are one
named line (exit 2, nothing touched), a run with nothing left to train says so, pruning never
keeps a damaged checkpoint in place of an intact one, and `trainer.steps=0` keeps its cold start.

One 5-step run (checkpoints at steps 2, 4 and 5; `keep_last` 2 leaves 4 and 5) is shared.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from warm_python import python

from megatron_gspo.checkpoint.steps import latest_step, list_steps

pytestmark = pytest.mark.slow  # training runs end to end through the CLI: 8-14 s each on a shared box

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "--config",
    str(REPO / "configs" / "tiny_moe_cpu.yaml"),
    "sft.steps=20",  # a policy that emits the answer format, so every RL step updates
    "sft.batch_size=16",
    "sft.target_accuracy=null",
    "eval.num_problems=4",
    "eval.every=0",
    "eval.at_start=false",
    "rollout.rollout_batch_size=2",
    "rollout.group_size=4",
    "rollout.temperature=1.0",
    "task.options.format_reward=0.5",  # partial credit: an untrained policy's groups still differ
    "algorithm.num_mini_batches=1",
    "trainer.save_every=2",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train(run_dir, *extra, timeout=300):
    cmd = [*python(), "-m", "megatron_gspo.cli", "train", *SMALL, f"trainer.run_dir={run_dir}", *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run5(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run5")
    done = train(run_dir, "trainer.steps=5")
    assert done.returncode == 0, done.stderr[-3000:]
    assert list_steps(run_dir / "checkpoints") == [4, 5]
    return run_dir


def _copy(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


def assert_one_named_line(done, *needles):
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    for needle in needles:
        assert needle in done.stderr, done.stderr[-3000:]


def test_resume_with_no_step_left_is_refused_and_rewrites_nothing(run5, tmp_path):
    run_dir = _copy(run5, tmp_path)
    config = (run_dir / "config.yaml").read_bytes()
    done = train(run_dir, "trainer.steps=1", "--resume")
    assert_one_named_line(done, "already reached step 5", "trainer.steps=1", "set trainer.steps above 5")
    assert (run_dir / "config.yaml").read_bytes() == config
    assert list_steps(run_dir / "checkpoints") == [4, 5]


def test_resume_with_every_checkpoint_damaged_is_one_line_naming_each(run5, tmp_path):
    """Not a CheckpointCorruptError traceback: the message that lists what is wrong with each."""
    run_dir = _copy(run5, tmp_path)
    for step in (4, 5):
        (run_dir / "checkpoints" / f"step_{step:08d}" / "trainer_state.pt").write_bytes(b"damaged")
    done = train(run_dir, "trainer.steps=6", "--resume")
    assert_one_named_line(done, "--resume: ", "step_00000005", "step_00000004")


@pytest.mark.parametrize(
    ("override", "restore"),
    [
        ("rollout.rollout_batch_size=4", "restore rollout.rollout_batch_size=2 (this run has 4)"),
        ("parallel.distributed_optimizer=true", "parallel.distributed_optimizer=false (this run has true)"),
        ("engine.dtype=bf16", "engine.dtype=fp32 (this run has bf16)"),
    ],
)
def test_resume_incompatibility_is_one_line_naming_the_setting(run5, tmp_path, override, restore):
    run_dir = _copy(run5, tmp_path)
    done = train(run_dir, "trainer.steps=6", override, "--resume")
    assert_one_named_line(done, "--resume:", "step_00000005 cannot continue with this config", restore)
    assert list_steps(run_dir / "checkpoints") == [4, 5]


def test_pruning_counts_only_intact_checkpoints(run5, tmp_path):
    run_dir = _copy(run5, tmp_path)
    root = run_dir / "checkpoints"
    shard = max((root / "step_00000005" / "dist").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    # Resumes from step 4; step 6 is saved and keep_last=2 prunes: the intact step 4 must stay.
    done = train(run_dir, "trainer.steps=6", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checkpoint step_00000005 is damaged and skipped" in done.stderr
    assert list_steps(root) == [4, 6]
    assert latest_step(root) == 6
    aside = [p.name for p in root.iterdir() if p.name.startswith("step_00000005.damaged-")]
    assert len(aside) == 1, sorted(p.name for p in root.iterdir())  # kept for inspection, not deleted


# The disk fills while megatron's writers write `dist/` (as write(2) says ENOSPC), then `train` runs.
_DISK_FULL = (
    "import errno, os, sys\n"
    "import megatron.core.dist_checkpointing.strategies.filesystem_async as writer\n"
    "def full(*args, **kwargs):\n"
    "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
    "writer._write_item = full\n"
    "from megatron_gspo.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_a_full_disk_at_a_save_is_one_line_and_keeps_the_checkpoints(run5, tmp_path):
    """Not a RuntimeError traceback with a step_*.tmp-* directory left: what was kept, and how to go on."""
    run_dir = _copy(run5, tmp_path)
    root = run_dir / "checkpoints"
    cmd = [sys.executable, "-c", _DISK_FULL, "train", *SMALL, f"trainer.run_dir={run_dir}"]
    done = subprocess.run(
        [*cmd, "trainer.steps=6", "--resume"], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert_one_named_line(
        done, "no space left on device saving checkpoint step 6", str(root), "step_00000005", "--resume"
    )
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000005"]
    assert latest_step(root) == 5


def test_zero_steps_saves_the_cold_start(tmp_path):
    done = train(tmp_path / "run", "trainer.steps=0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert latest_step(tmp_path / "run" / "checkpoints") == 0


def export(checkpoint, out, *extra):
    cmd = [
        *python(),
        "-m",
        "megatron_gspo.cli",
        "export",
        "--checkpoint",
        str(checkpoint),
        "--out",
        str(out),
        *extra,
    ]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_export_never_replaces_what_it_did_not_write(run5, tmp_path):
    run_dir = _copy(run5, tmp_path)
    (run_dir / "notes.txt").write_text("mine")
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    done = export(run_dir / "checkpoints" / "step_00000005", run_dir)
    assert_one_named_line(done, f"--out {run_dir} is not an earlier HF export", "checkpoints/", "notes.txt")
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before

    out = tmp_path / "hf"
    for step in (4, 5):  # an earlier export is replaced
        done = export(run_dir / "checkpoints" / f"step_{step:08d}", out)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"exported step {step}" in done.stdout
    (out / "notes.txt").write_text("mine")
    assert_one_named_line(export(run_dir / "checkpoints" / "step_00000004", out), "notes.txt")
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").is_file()

    # a base model saved by transformers (the same file names as an export) given by mistake
    base = tmp_path / "base"
    shutil.copytree(out, base)
    (base / "notes.txt").unlink()
    (base / "megatron_gspo_export.json").unlink()
    weights = (base / "model.safetensors").read_bytes()
    step5 = run_dir / "checkpoints" / "step_00000005"
    assert_one_named_line(export(step5, base), "megatron-gspo did not write", "--overwrite")
    assert (base / "model.safetensors").read_bytes() == weights
    done = export(step5, base, "--overwrite")
    assert done.returncode == 0 and "exported step 5" in done.stdout, done.stderr[-3000:]


@pytest.mark.slow
def test_a_second_run_on_a_directory_in_use_is_refused(tmp_path):
    sync_dir = tmp_path / "weights"
    first = subprocess.Popen(
        [
            sys.executable,  # fresh: the lock names this process's pid
            "-m",
            "megatron_gspo.cli",
            "train",
            *SMALL,
            f"trainer.run_dir={tmp_path / 'a'}",
            "trainer.steps=100000",
            f"trainer.weight_sync_dir={sync_dir}",
        ],  # fmt: skip
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "a" / "metrics.jsonl").is_file():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.5)
        # Stopped, it still holds both locks and burns no CPU under the refused starts.
        os.kill(first.pid, signal.SIGSTOP)
        same_run_dir = train(tmp_path / "a", "trainer.steps=2", f"trainer.weight_sync_dir={tmp_path / 'w2'}")
        assert_one_named_line(
            same_run_dir, f"trainer.run_dir={tmp_path / 'a'} is in use by another run (pid {first.pid}"
        )
        same_sync_dir = train(tmp_path / "b", "trainer.steps=2", f"trainer.weight_sync_dir={sync_dir}")
        assert_one_named_line(same_sync_dir, f"trainer.weight_sync_dir={sync_dir} is in use by another run")
        assert first.poll() is None  # the first run is untouched
    finally:  # the lock is what this test checks; how fast SIGTERM ends a run is the launcher test's
        first.terminate()
        os.kill(first.pid, signal.SIGCONT)  # to take the SIGTERM
        try:
            first.wait(timeout=120)
        except subprocess.TimeoutExpired:
            first.kill()  # the kernel drops the lock of a killed process too
            first.wait(timeout=60)
    assert train(tmp_path / "b", "trainer.steps=1", f"trainer.weight_sync_dir={sync_dir}").returncode == 0
