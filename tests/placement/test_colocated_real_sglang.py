"""A colocated run with real SGLang 0.5.23 (rollout.engine=sglang, its CPU engine): every step the
trainer releases the server's memory, trains, resumes it and sends the weights by tensor handles.

On the CPU SGLang has no memory saver (torch_memory_saver needs CUDA), so its release and resume
free nothing: the run says so at start-up. What the run shows is the order of the calls against
SGLang's own scheduler, which the embedded server only imitates: a resume of a tag not released,
or a second release, kills SGLang's scheduler (docs/sglang-conformance.md).
"""

import os
import re
import subprocess
from pathlib import Path

import pytest
from warm_python import python

from megatron_gspo.rollout.sglang_launch import sglang_unavailable
from megatron_gspo.training.metrics import read_metrics

pytestmark = [
    pytest.mark.slow,  # SGLang's start and a 3-step run
    pytest.mark.skipif(sglang_unavailable() is not None, reason=str(sglang_unavailable())),
]

REPO = Path(__file__).resolve().parents[2]
RUN = [
    "--config",
    str(REPO / "configs" / "tiny_moe_cpu.yaml"),
    "rollout.engine=sglang",
    "rollout.placement=colocated",
    "weight_sync.method=tensor",
    "trainer.steps=3",
    "sft.steps=30",
    "task.options.format_reward=0.5",
    "eval.num_problems=10",
    "rollout.rollout_batch_size=8",
    "rollout.group_size=4",
    "algorithm.num_mini_batches=2",
    "logging.progress_bar=false",
    "trainer.seed=1234",  # a 30-step cold start with mixed rewards, so steps train
]


def test_colocated_run_releases_and_resumes_real_sglang_every_step(tmp_path):
    done = subprocess.run(
        [*python(), "-m", "megatron_gspo.cli", "train", *RUN, f"trainer.run_dir={tmp_path}"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "runs on the CPU without the memory saver (SGLang's needs CUDA)" in done.stderr
    log = (tmp_path / "sglang" / "server-0.log").read_text()
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all("colocate/release_s" in r and "colocate/resume_s" in r for r in steps)
    assert len(re.findall(r"POST /release_memory_occupation HTTP/1.1\" 200", log)) >= 3
    assert len(re.findall(r"POST /resume_memory_occupation HTTP/1.1\" 200", log)) >= 3
    assert "Scheduler hit an exception" not in log
    trained = [r for r in steps if r["train/all_zero_adv_batch"] == 0.0]
    assert trained and all(r["sync/attempts"] == 1 for r in trained)
