"""A fleet of real SGLang 0.5.23 workers (CPU engine) behind the real sglang-router, one lost mid-run."""

import concurrent.futures as cf
import os
import signal

import pytest
from test_fleet_loss import sigterm, start_train, wait_for_step

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.rollout.router_launch import launch_router, router_available
from megatron_gspo.rollout.sglang_launch import launch_sglang_server, sglang_unavailable
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

pytestmark = [
    pytest.mark.slow,  # two SGLang starts, a router and a train run
    pytest.mark.skipif(sglang_unavailable() is not None, reason=str(sglang_unavailable())),
    pytest.mark.skipif(router_available() is not None, reason=str(router_available())),
]


def test_a_fleet_of_real_sglang_workers_behind_the_router_loses_one_and_goes_on(tmp_path):
    """Two SGLang workers behind the real sglang-router, update_mode=pause (SGLang's own pause): one
    SIGKILLed mid-run (its whole process group: launcher, scheduler, detokenizer) is dropped from the
    pauses and syncs, the run goes on on the other, and SIGTERM ends it."""
    checkpoint = make_tiny_hf_checkpoint(tmp_path / "tiny", tiny(vocab_size=len(build_char_tokenizer())))
    with cf.ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(launch_sglang_server, checkpoint, log_path=tmp_path / f"worker-{i}.log")
            for i in range(2)
        ]
        a, b = (future.result() for future in starting)
    with a, b, launch_router([a.url, b.url]) as router:
        run, run_dir = start_train(
            tmp_path, checkpoint, router, "fleet", max_staleness=2, update_mode="pause"
        )
        try:
            lost_at = wait_for_step(run, run_dir, 3)["step"]
            os.killpg(b.process.pid, signal.SIGKILL)
            later = wait_for_step(run, run_dir, lost_at + 3)
            assert later["fleet/workers"] == 1 and later["fleet/removed"] == 1, later
            assert sigterm(run) == 128 + signal.SIGTERM
        finally:
            if run.poll() is None:
                run.kill()
    said = (tmp_path / "fleet.log").read_text()
    assert said.count(f"rollout worker {b.url} removed from the fleet: ") == 1, said[-3000:]
    assert "stopped by SIGTERM" in said and "Traceback" not in said, said[-3000:]
