"""`megatron-gspo train --nproc 2` (the launcher, real torchrun, two workers, the embedded rollout
server) stopped by SIGTERM or SIGINT: the launcher waits, and no process of the job outlives it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_gspo.python_command import PYTHON_VAR

REPO = Path(__file__).resolve().parents[2]
# Every process of the job is the launcher's descendant, the server too: none forked elsewhere
# (tests/warm_python.py), so that what outlives the launcher is seen.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ENV.pop(PYTHON_VAR, None)


def _descendants(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_stops_the_whole_job(tmp_path, signum):
    run_dir = tmp_path / "run"
    config = str(REPO / "configs" / "tiny_moe_cpu.yaml")
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", "--config", config, "--nproc", "2",
           "sft.steps=0", "sft.target_accuracy=null", "trainer.steps=100000", "eval.at_start=false",
           "eval.every=0", "rollout.rollout_batch_size=2", "rollout.group_size=2",
           "algorithm.num_mini_batches=1", "logging.progress_bar=false",
           f"trainer.run_dir={run_dir}"]  # fmt: skip
    stderr = (tmp_path / "stderr.txt").open("w")
    launcher = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=stderr)
    job = []
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").is_file():  # training: workers and server are up
            assert launcher.poll() is None, "the run ended before it was signalled"
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        job = _descendants(launcher.pid)
        lines = [" ".join(p.cmdline()) for p in job]
        # torchrun's agent is the launcher forked (its command line), leading its own session
        (agent,) = [p for p in job if p.cmdline() == launcher.args]
        assert os.getsid(agent.pid) == agent.pid
        assert sum("-m megatron_gspo.cli train" in line for line in lines) == 1, lines  # the agent
        # the two ranks are forked from the server that imported what a rank imports
        (forkserver,) = [p for p in agent.children() if "multiprocessing.forkserver" in " ".join(p.cmdline())]
        assert "megatron_gspo.training.forkserver_preload" in " ".join(forkserver.cmdline())
        assert len(forkserver.children()) == 2, lines
        assert sum("rollout.server" in line for line in lines) == 1, lines
        launcher.send_signal(signum)
        code = launcher.wait(timeout=120)
        alive = [p for p in job if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"outlived the launcher: {[' '.join(p.cmdline())[:80] for p in alive]}"
        assert code == 128 + signum
        # one line says what was saved and what is lost; no traceback from any rank
        said = (tmp_path / "stderr.txt").read_text()
        stopped = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        assert said.count(f"megatron-gspo train: stopped by {stopped}; ") == 1, said[-3000:]
        assert "Traceback" not in said and "KeyboardInterrupt" not in said, said[-3000:]
    finally:
        for proc in [*job, *_descendants(launcher.pid)]:  # whatever an old launcher left behind
            if proc.is_running():
                proc.kill()
        if launcher.poll() is None:
            launcher.kill()
