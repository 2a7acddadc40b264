"""Suite-wide fixtures and markers.

A test that starts several processes (torchrun, gloo) is also `slow`, and so is a test on the
`short_run` fixture (a real training run): `pytest -m "not slow"` is the quick subset, every
module, single-process tests of seconds.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHORT_RUN = [
    "--config",
    str(REPO / "configs" / "tiny_moe_cpu.yaml"),
    "trainer.steps=4",
    "trainer.save_every=2",
    "sft.steps=30",
    "task.options.format_reward=0.5",  # partial credit: non-zero advantages in 4 steps
    "rollout.temperature=1.0",
    "rollout.dtype=bf16",  # a bf16 server: non-zero rollout/trainer mismatch
    "rollout.rollout_batch_size=8",
    "rollout.group_size=4",
    "algorithm.num_mini_batches=2",
    "drift.enabled=true",
    "eval.every=2",
    "eval.num_problems=20",
    "logging.progress_bar=false",
]


@pytest.fixture(scope="session")
def short_run(tmp_path_factory) -> Path:
    """Run directory of a real 4-step `megatron-gspo train` of the tiny MoE (checkpoints at 2 and 4).

    Its metrics hold rewards, accuracy, KL, clip fractions, mismatch by length and per-layer
    drift; tools and reports are tested on it as a user would point them at their own run.
    """
    run_dir = tmp_path_factory.mktemp("short_run") / "run"
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", *SHORT_RUN, f"trainer.run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return run_dir


def pytest_collection_modifyitems(items):
    for item in items:
        expensive = item.get_closest_marker("multiprocess") is not None or "short_run" in item.fixturenames
        if expensive and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
