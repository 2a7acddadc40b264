"""Resume in a fresh process equals the uninterrupted run: world 1 (also from a checkpoint saved
before the first optimizer step), and EP2 x DP2 under torchrun (the resumed run saving again),
also when the newest checkpoint is damaged on one rank (all ranks fall back together)."""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from forked_torchrun import torchrun
from warm_python import python

from megatron_gspo.checkpoint.meta import read_meta
from megatron_gspo.checkpoint.steps import latest_step, newest_reshardable_step

WORKER = Path(__file__).with_name("ckpt_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _launch(mode, root, out, *, world=1, extra=(), log=None):
    command = torchrun(world, WORKER) if world > 1 else [*python(), str(WORKER)]
    cmd = [*command, mode, "--root", str(root), "--out", str(out), *extra]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    if log is not None:
        log.append(done.stderr)
    return [torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in range(world)]


def _assert_same_continuation(full, resumed, steps=2):
    assert len(full["metrics"]) == steps
    assert resumed["metrics"] == full["metrics"]  # losses, grad norms, learning rates: exact
    assert full["weights"].keys() == resumed["weights"].keys()
    assert all(torch.equal(full["weights"][k], resumed["weights"][k]) for k in full["weights"])
    for key in ("torch", "tracker"):
        assert torch.equal(resumed["probes"][key], full["probes"][key])
    assert np.array_equal(resumed["probes"]["numpy"], full["probes"]["numpy"])
    assert resumed["probes"]["python"] == full["probes"]["python"]
    assert resumed["trainer_state"] == full["trainer_state"] and resumed["loss_std"] == full["loss_std"]


def test_resume_in_a_fresh_process_matches_the_uninterrupted_run(tmp_path):
    (full,) = _launch("full", tmp_path / "ckpt", tmp_path / "full")
    assert latest_step(tmp_path / "ckpt") == 3
    (resumed,) = _launch("resume", tmp_path / "ckpt", tmp_path / "resumed")
    _assert_same_continuation(full, resumed)


@pytest.mark.parametrize("distopt", [False, True], ids=["adam", "distributed_optimizer"])
def test_checkpoint_saved_before_the_first_optimizer_step_resumes_exactly(tmp_path, distopt):
    """A run stopped before any update (every step skipped so far) continues as if never stopped."""
    extra = ("--save-at", "0", "--steps", "2", *("--distopt",) * distopt)
    (full,) = _launch("full", tmp_path / "ckpt", tmp_path / "full", extra=extra)
    meta = read_meta(tmp_path / "ckpt" / "step_00000000")
    assert meta["optimizer_step"] is None and meta["optimizer_state"] is False
    (resumed,) = _launch("resume", tmp_path / "ckpt", tmp_path / "resumed", extra=extra)
    _assert_same_continuation(full, resumed)


@pytest.mark.multiprocess
@pytest.mark.parametrize("routine", [False, True], ids=["fully_reshardable", "dp_reshardable"])
def test_expert_parallel_distributed_optimizer_resume_is_exact(tmp_path, routine):
    args = ("--ep", "2", "--distopt", *("--routine",) * routine)
    full = _launch("full", tmp_path / "ckpt", tmp_path / "full", world=2, extra=args)
    meta = read_meta(tmp_path / "ckpt" / "step_00000003")
    assert meta["layout"]["expert_parallel"] == 2 and meta["layout"]["data_parallel"] == 2
    assert meta["layout"]["distributed_optimizer"] is True
    assert meta["optimizer_sharding"] == ("dp_reshardable" if routine else "fully_reshardable")
    ours = {name for name in meta["files"] if not name.startswith(("dist/", "model/"))}
    assert ours == {"rank_00000.pt", "rank_00001.pt", "trainer_state.pt"}
    # Both ranks wrote megatron data files (fully parallel save).
    assert {"dist/__0_0.distcp", "dist/__1_0.distcp"} <= set(meta["files"])
    # The resumed run saves once more and loads that checkpoint back (its weights are compared).
    resumed = _launch("resume", tmp_path / "ckpt", tmp_path / "resumed", world=2, extra=(*args, "--resave"))
    for rank in range(2):
        _assert_same_continuation(full[rank], resumed[rank])
        assert resumed[rank]["optimizer_step"] == full[rank]["optimizer_step"] == 5
    assert read_meta(tmp_path / "ckpt" / "step_00000005")["optimizer_step"] == 5
    # Each rank restored its own RNG streams (they differ between ranks).
    assert full[0]["probes"]["python"] != full[1]["probes"]["python"]
    # The same checkpoint refused by a single process (a different layout).
    done = subprocess.run(
        [
            *python(),
            str(WORKER),
            "resume",
            "--root",
            str(tmp_path / "ckpt"),
            "--out",
            str(tmp_path / "x"),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "written with layout world=2 TP=1 PP=1 EP=2 ETP=1 DP=2 distributed_optimizer=True" in done.stderr
    assert "this run has world=1 TP=1 PP=1 EP=1 ETP=1 DP=1 distributed_optimizer=False" in done.stderr


@pytest.mark.multiprocess
def test_damaged_shard_on_one_rank_makes_every_rank_resume_from_the_previous_checkpoint(tmp_path):
    args = ("--ep", "2", "--distopt")
    root = tmp_path / "ckpt"
    full = _launch("full", root, tmp_path / "full", world=2, extra=(*args, "--save-at", "2", "3"))
    assert latest_step(root) == 3
    shard = root / "step_00000003" / "rank_00001.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit: same size, only the checksum can tell
    shard.write_bytes(bytes(data))
    log = []
    resumed = _launch("resume", root, tmp_path / "resumed", world=2, extra=(*args, "--fallback"), log=log)
    for rank in range(2):  # rank 0's own shard of step 3 is intact, yet it resumes from step 2 too
        _assert_same_continuation(full[rank], resumed[rank], steps=3)
    assert log[0].count("checkpoint step_00000003 is damaged and skipped") == 1  # said once, by rank 0
    assert f"{shard} is corrupt: its sha256 is" in log[0]
    assert "resuming from step_00000002, the newest intact checkpoint" in log[0]
    assert latest_step(root) == 2


@pytest.mark.multiprocess
def test_routine_checkpoint_refuses_another_data_parallel_size(tmp_path):
    """A dp_reshardable save (DP=2) is refused at DP=1, naming the reshardable save to use;
    the newest reshardable checkpoint outlives `keep_last` and loads at DP=1."""
    root = tmp_path / "ckpt"
    args = ("--distopt", "--routine", "--save-at", "1", "2", "3", "--steps", "3")
    _launch("full", root, tmp_path / "full", world=2, extra=args)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000003"]
    assert newest_reshardable_step(root) is None
    cmd = [*python(), str(WORKER), "resume", "--root", str(root), "--out", str(tmp_path / "x")]
    done = subprocess.run([*cmd, "--distopt"], env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "CheckpointLayoutError" in done.stderr
    assert "is a routine checkpoint (distributed optimizer state saved dp_reshardable" in done.stderr
    assert "world=2 TP=1 PP=1 EP=1 ETP=1 DP=2 distributed_optimizer=True" in done.stderr
    assert "this run has world=1 TP=1 PP=1 EP=1 ETP=1 DP=1 distributed_optimizer=True" in done.stderr
    assert "trainer.reshardable_every" in done.stderr and "there is none under" in done.stderr
