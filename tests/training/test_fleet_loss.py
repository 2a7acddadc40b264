"""`megatron-gspo train` behind SGLang's real router when a worker dies under update_mode pause / partial.

A worker SIGKILLed mid-run is dropped from the pause, the weight sync and the continue; the others
are continued and the run goes on while rollout.min_workers remain (below, it stops with
FleetTooSmallError naming the lost worker, after saving the step it trained). SIGTERM then ends the
run in seconds. A worker left paused (as a run killed mid-sync leaves it) is continued at start-up
by the next run, which names it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from warm_python import kill_server, python

from megatron_gspo.checkpoint.meta import step_dir_name
from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.rollout.router_launch import launch_router, router_available
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

pytestmark = [
    pytest.mark.skipif(router_available() is not None, reason=str(router_available())),
    pytest.mark.slow,  # workers, a router and a `train` run per test
]

TOKENIZER = build_char_tokenizer()
GUARD_S = 120  # hang guard of each wait, many times what it takes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("fleet") / "tiny", tiny(vocab_size=len(TOKENIZER)))


def start_train(tmp_path: Path, checkpoint, router, name: str, **rollout) -> tuple[subprocess.Popen, Path]:
    """A `train` run of many tiny steps behind `router`; (its process, its run dir). Its log: name.log."""
    run_dir = tmp_path / name
    options = ", ".join(f"{k}: {v}" for k, v in rollout.items())
    config = tmp_path / f"{name}.yaml"
    config.write_text(
        f"model: {{hf_path: {checkpoint}}}\n"
        "task: {name: addition, options: {min_digits: 1, max_digits: 2}}\n"
        "sft: {steps: 0}\n"
        "rollout: {rollout_batch_size: 2, group_size: 2, max_new_tokens: 16, temperature: 1.0,\n"
        f"          router_url: '{router.url}', {options}}}\n"
        "algorithm: {num_mini_batches: 1}\n"
        "eval: {at_start: false, at_end: false, every: 0}\n"
        f"trainer: {{steps: 100000, run_dir: {run_dir}}}\n"
        "logging: {progress_bar: false}\n"
    )
    cmd = [*python(), "-m", "megatron_gspo.cli", "train", "--config", str(config)]
    log = (tmp_path / f"{name}.log").open("w")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), run_dir


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def wait_for_step(run, run_dir: Path, step: int) -> dict:
    """The metrics row of `step` once written (the run must still be going)."""
    deadline = time.monotonic() + GUARD_S
    while not (done := [r for r in rows(run_dir) if r["step"] >= step]):
        assert run.poll() is None, f"the run ended with {run.returncode} before step {step}"
        assert time.monotonic() < deadline, f"no step {step} after {GUARD_S} s: {rows(run_dir)[-1:]}"
        time.sleep(0.1)
    return done[0]


def log_of(tmp_path: Path, name: str) -> str:
    return (tmp_path / f"{name}.log").read_text()


def sigterm(run) -> int:
    run.send_signal(signal.SIGTERM)
    return run.wait(timeout=60)  # hang guard: the run unwinds in seconds


def test_a_paused_worker_is_continued_at_start_up_a_lost_one_dropped_and_sigterm_ends_the_run(
    checkpoint, tmp_path
):
    with (
        launch_embedded_server(checkpoint) as a,
        launch_embedded_server(checkpoint) as b,
        launch_router([a.url, b.url]) as router,
    ):
        # a left paused, as a run killed mid-sync leaves it: this run continues it and names it.
        httpx.post(f"{a.url}/pause_generation", json={"mode": "retract"}, timeout=10).raise_for_status()
        run, run_dir = start_train(
            tmp_path, checkpoint, router, "pause", max_staleness=2, update_mode="pause"
        )
        try:
            lost_at = wait_for_step(run, run_dir, 3)["step"]
            kill_server(b)
            later = wait_for_step(run, run_dir, lost_at + 3)  # the next pauses and syncs skip b
            assert later["fleet/workers"] == 1 and later["fleet/removed"] == 1, later
            assert sigterm(run) == 128 + signal.SIGTERM
        finally:
            if run.poll() is None:
                run.kill()
        said = log_of(tmp_path, "pause")
        assert f"start-up: rollout server {a.url} was paused (GET /ready: 503): continued it" in said, said
        assert said.count(f"rollout worker {b.url} removed from the fleet: ") == 1, said[-3000:]
        assert "stopped by SIGTERM" in said and "Traceback" not in said, said[-3000:]
        assert httpx.get(f"{a.url}/ready", timeout=10).status_code == 200  # not left paused


def test_workers_lost_under_partial_the_run_goes_on_then_stops_by_name_with_a_checkpoint(
    checkpoint, tmp_path
):
    with (
        launch_embedded_server(checkpoint) as a,
        launch_embedded_server(checkpoint) as b,
        launch_embedded_server(checkpoint) as c,
        launch_router([a.url, b.url, c.url]) as router,
    ):
        run, run_dir = start_train(
            tmp_path, checkpoint, router, "partial", max_staleness=2, update_mode="partial", min_workers=2
        )
        try:
            lost_at = wait_for_step(run, run_dir, 3)["step"]
            kill_server(c)
            later = wait_for_step(run, run_dir, lost_at + 3)  # two workers left: min_workers
            assert later["fleet/workers"] == 2 and later["fleet/removed"] == 1, later
            kill_server(b)
            code = run.wait(timeout=GUARD_S)
        finally:
            if run.poll() is None:
                run.kill()
        said = log_of(tmp_path, "partial")
        assert code == 1, said[-3000:]
        stop = f"rollout server failed: 1 healthy rollout worker(s) left behind {router.url}, "
        assert stop + f"rollout.min_workers=2 (lost: {b.url}: " in said, said[-3000:]
        last = rows(run_dir)[-1]["step"]
        saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
        assert saved == [step_dir_name(last + 1)], (saved, last)  # the step trained before the stop
