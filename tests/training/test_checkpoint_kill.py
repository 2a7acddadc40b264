"""SIGKILL in the middle of a save never leaves `latest` naming an incomplete checkpoint."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from ckpt_common import build_run, train_step
from warm_python import python

from megatron_gspo.checkpoint.load import load_checkpoint
from megatron_gspo.checkpoint.save import save_checkpoint
from megatron_gspo.checkpoint.steps import latest_step, list_steps
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.sharding import gather_global_state_dict

WORKER = Path(__file__).with_name("ckpt_kill_worker.py")


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    init_distributed(ParallelConfig())
    yield
    destroy_distributed()


def _kill_during_save(tmp_path, point):
    ready = tmp_path / "blocked"
    cmd = [
        *python(),
        str(WORKER),
        "--root",
        str(tmp_path / "ckpt"),
        "--reference",
        str(tmp_path / "ref.pt"),
    ]
    proc = subprocess.Popen(
        [*cmd, "--ready", str(ready), "--point", point],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 240
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(
                f"worker exited with {proc.returncode}: {proc.stderr.read().decode()[-3000:]}"
            )
        assert time.monotonic() < deadline, "worker never reached the kill point"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("point", ["writing", "publish", "latest"])
def test_sigkill_mid_save_leaves_previous_checkpoint_latest(tmp_path, point):
    _kill_during_save(tmp_path, point)
    root = tmp_path / "ckpt"
    leftovers = sorted(p.name for p in root.iterdir())
    assert latest_step(root) == 1
    if point == "latest":  # renamed but never published: complete, yet not what `latest` names
        assert leftovers[0].startswith(".latest.tmp-")
        assert leftovers[1:] == ["latest", "step_00000001", "step_00000002"]
    else:
        assert leftovers[:2] == ["latest", "step_00000001"] and leftovers[2].startswith("step_00000002.tmp-")

    reference = torch.load(tmp_path / "ref.pt", weights_only=False)
    run = build_run(ParallelConfig(), init=False)
    state = load_checkpoint(root, model=run.ddp, optimizer=run.optimizer, scheduler=run.scheduler)
    assert state == reference["state"] and state["step"] == 1
    weights = gather_global_state_dict(run.model)
    assert all(torch.equal(weights[k], reference["weights"][k]) for k in reference["weights"])

    # The resumed run saves its own step 2 over whatever the crash left behind.
    run.load_trainer_state(state)
    train_step(run)
    save_checkpoint(
        root,
        2,
        model=run.ddp,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        trainer_state=run.trainer_state(),
    )
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002"]
    assert latest_step(root) == 2 and list_steps(root) == [1, 2]
    assert load_checkpoint(root, model=run.ddp, optimizer=run.optimizer, scheduler=run.scheduler)["step"] == 2
