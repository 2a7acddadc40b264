"""A colocated run with real SGLang 0.5.23 (rollout.engine=sglang, its CPU engine): every step the
trainer releases the server's memory, trains, resumes it and sends the weights by tensor handles.

On the CPU SGLang has no memory saver (torch_memory_saver needs CUDA), so its release and resume
free nothing: the run says so at start-up. What the run shows is the order of the calls against
SGLang's own scheduler, which the embedded server only imitates: a resume of a tag not released,
or a second release, kills SGLang's scheduler (docs/sglang-conformance.md).
"""

import re

import pytest
from sglang_runs import rl_steps, train_with_sglang

from megatron_gspo.rollout.sglang_launch import sglang_unavailable

pytestmark = [
    pytest.mark.slow,  # SGLang's start and a 3-step run
    pytest.mark.skipif(sglang_unavailable() is not None, reason=str(sglang_unavailable())),
]

COLOCATED = ["rollout.placement=colocated", "weight_sync.method=tensor"]


def test_colocated_run_releases_and_resumes_real_sglang_every_step(tmp_path):
    done = train_with_sglang(tmp_path, *COLOCATED)
    assert "runs on the CPU without the memory saver (SGLang's needs CUDA)" in done.stderr
    log = (tmp_path / "sglang" / "server-0.log").read_text()
    steps = rl_steps(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all("colocate/release_s" in r and "colocate/resume_s" in r for r in steps)
    assert len(re.findall(r"POST /release_memory_occupation HTTP/1.1\" 200", log)) >= 3
    assert len(re.findall(r"POST /resume_memory_occupation HTTP/1.1\" 200", log)) >= 3
    assert "Scheduler hit an exception" not in log
    trained = [r for r in steps if r["train/all_zero_adv_batch"] == 0.0]
    assert trained and all(r["sync/attempts"] == 1 for r in trained)
