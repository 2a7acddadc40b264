"""Checkpoint save/load in one process at world size 1: round trips, pruning, and every refusal."""

import importlib.metadata
import json
import random
import shutil

import numpy as np
import pytest
import torch
from ckpt_common import build_run, draw_probes, load_run, save_run, train_step

from megatron_gspo.checkpoint.files import write_meta
from megatron_gspo.checkpoint.meta import CheckpointError, read_meta
from megatron_gspo.checkpoint.rng_state import capture_rng_state, restore_rng_state
from megatron_gspo.checkpoint.save import save_checkpoint
from megatron_gspo.checkpoint.steps import latest_step, list_steps, newest_reshardable_step
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    init_distributed(ParallelConfig())
    yield
    destroy_distributed()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run trained 2 steps and checkpointed at step 2 (plain Adam)."""
    root = tmp_path_factory.mktemp("saved")
    run = build_run(ParallelConfig(), init=False)
    for _ in range(2):
        train_step(run)
    save_run(run, root)
    return root, run


@pytest.mark.parametrize(
    "dtype,distributed_optimizer,reshardable",
    [
        ("fp32", False, True),
        ("fp32", True, True),
        ("fp32", True, False),
        ("bf16", False, True),
        ("bf16", True, True),
        ("bf16", True, False),
    ],
    ids=["fp32", "fp32-distopt", "fp32-distopt-routine", "bf16", "bf16-distopt", "bf16-distopt-routine"],
)
def test_resumed_run_continues_bit_exactly(tmp_path, dtype, distributed_optimizer, reshardable):
    """bf16: the fp32 main params are restored too (bf16 weights alone would not continue exactly).

    Routine saves (`reshardable=False`) keep the distributed optimizer's own buffer slices.
    """
    parallel = ParallelConfig(distributed_optimizer=distributed_optimizer)
    original = build_run(parallel, init=False, dtype=dtype)
    for _ in range(3):
        train_step(original)
    save_run(original, tmp_path, reshardable=reshardable)
    expected_probes = draw_probes()
    expected = [train_step(original) for _ in range(2)]

    resumed = build_run(parallel, init=False, dtype=dtype)  # different initial weights: the RNG moved on
    embedding = "embedding.word_embeddings.weight"
    assert not torch.equal(resumed.ddp.state_dict()[embedding], original.ddp.state_dict()[embedding])
    torch.manual_seed(99), np.random.seed(99), random.seed(99)  # scramble every stream
    state = load_run(resumed, tmp_path)
    probes = draw_probes()
    resumed.load_trainer_state(state)
    assert state["step"] == 3 and state["data"]["batches_drawn"] == 3 and state["loss_stats"]["count"] == 3
    assert [train_step(resumed) for _ in range(2)] == expected
    for key in ("torch", "tracker"):
        assert torch.equal(probes[key], expected_probes[key])
    assert (
        np.array_equal(probes["numpy"], expected_probes["numpy"])
        and probes["python"] == expected_probes["python"]
    )
    a, b = original.ddp.state_dict(), resumed.ddp.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))
    assert resumed.scheduler.num_steps == original.scheduler.num_steps == 5
    assert resumed.stats.state_dict() == original.stats.state_dict()


def test_rng_state_round_trip_and_missing_stream():
    state = capture_rng_state()
    first = draw_probes()
    restore_rng_state(state)
    again = draw_probes()
    assert torch.equal(first["torch"], again["torch"]) and torch.equal(first["tracker"], again["tracker"])
    assert first["python"] == again["python"] and np.array_equal(first["numpy"], again["numpy"])
    del state["numpy"]
    with pytest.raises(ValueError, match=r"lacks \['numpy'\]"):
        restore_rng_state(state)


def test_layout_meta_and_latest(saved):
    root, run = saved
    assert latest_step(root) == 2 and list_steps(root) == [2]
    assert (root / "latest").read_text() == "step_00000002\n"
    meta = read_meta(root / "step_00000002")
    assert meta["step"] == 2 and meta["weight_version"] == 2
    assert meta["layout"] == {
        "world_size": 1,
        "tensor_parallel": 1,
        "pipeline_parallel": 1,
        "expert_parallel": 1,
        "expert_tensor_parallel": 1,
        "data_parallel": 1,
        "distributed_optimizer": False,
    }
    assert meta["versions"]["megatron-core"] == importlib.metadata.version("megatron-core")
    assert meta["trainer_state"] == run.trainer_state()
    assert meta["optimizer_step"] == 2 and meta["scheduler"] == run.scheduler.state_dict()
    directory = root / "step_00000002"
    dist_files = {f"dist/{p.name}" for p in (directory / "dist").iterdir()}
    # megatron's torch_dist files: global metadata, format, rank 0's data files (+ common.pt on 0.16).
    assert {"dist/.metadata", "dist/metadata.json"} < dist_files
    assert any(name.endswith(".distcp") for name in dist_files)
    model_files = {f"model/{p.name}" for p in (directory / "model").iterdir()}
    assert {"model/config.json", "model/tokenizer_config.json"} < model_files  # for `export`
    assert set(meta["files"]) == {"rank_00000.pt", "trainer_state.pt"} | dist_files | model_files
    assert sorted(p.name for p in directory.iterdir()) == [
        "dist",
        "meta.json",
        "model",
        "rank_00000.pt",
        "trainer_state.pt",
    ]


def test_empty_root_has_nothing_to_resume(tmp_path):
    run = build_run(ParallelConfig(), init=False)
    assert latest_step(tmp_path) is None and list_steps(tmp_path / "absent") == []
    assert load_run(run, tmp_path) is None
    with pytest.raises(CheckpointError, match="no checkpoint for step 4"):
        load_run(run, tmp_path, step=4)


def test_keep_last_prunes_old_checkpoints_and_explicit_step_loads(tmp_path):
    run = build_run(ParallelConfig(), init=False)
    weights = {}
    for _ in range(4):
        train_step(run)
        save_run(run, tmp_path, keep_last=2)
        weights[run.step] = run.model.embedding.word_embeddings.weight.detach().clone()
    assert list_steps(tmp_path) == [3, 4] and latest_step(tmp_path) == 4
    state = load_run(run, tmp_path, step=3)
    assert state["step"] == 3
    assert torch.equal(run.model.embedding.word_embeddings.weight, weights[3])
    with pytest.raises(CheckpointError, match="already the latest checkpoint"):
        save_checkpoint(
            tmp_path, 4, model=run.ddp, optimizer=run.optimizer, scheduler=run.scheduler, trainer_state={}
        )
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        save_run(run, tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="trainer_state must be a dict"):
        save_checkpoint(
            tmp_path, 5, model=run.ddp, optimizer=run.optimizer, scheduler=run.scheduler, trainer_state=[]
        )


def test_keep_last_keeps_the_newest_reshardable_checkpoint(tmp_path):
    """Routine distributed-optimizer saves do not push the only reshardable one out."""
    run = build_run(ParallelConfig(distributed_optimizer=True), init=False)
    for reshardable in (True, False, True, False, False, False):
        train_step(run)
        save_run(run, tmp_path, keep_last=2, reshardable=reshardable)
    assert list_steps(tmp_path) == [3, 5, 6] and newest_reshardable_step(tmp_path) == 3
    assert [read_meta(tmp_path / f"step_0000000{s}")["optimizer_sharding"] for s in (3, 5)] == [
        "fully_reshardable",
        "dp_reshardable",
    ]


def test_stale_temporary_directories_are_removed_by_the_next_save(tmp_path):
    run = build_run(ParallelConfig(), init=False)
    train_step(run)
    (tmp_path / "step_00000007.tmp-abc123").mkdir(parents=True)
    (tmp_path / "step_00000007.tmp-abc123" / "rank_00000.pt").write_bytes(b"partial")
    (tmp_path / "step_00000001").mkdir()  # complete-looking leftover that `latest` never named
    (tmp_path / "step_00000001" / "junk").write_text("x")
    save_run(run, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
    assert not (tmp_path / "step_00000001" / "junk").exists() and load_run(run, tmp_path)["step"] == 1


def _copy(saved, tmp_path):
    root, _ = saved
    shutil.copytree(root, tmp_path / "ckpt")
    return tmp_path / "ckpt", tmp_path / "ckpt" / "step_00000002"


def test_corrupt_meta_is_refused(saved, tmp_path):
    root, directory = _copy(saved, tmp_path)
    run = build_run(ParallelConfig(), init=False)
    (directory / "meta.json").write_text('{"step": 2, "layo')
    with pytest.raises(CheckpointError, match=r"meta.json is corrupt \(not valid JSON"):
        load_run(run, root)
    (directory / "meta.json").write_text('{"step": 2}')
    with pytest.raises(CheckpointError, match=r"meta.json is corrupt: needs fields"):
        load_run(run, root)
    (directory / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="meta.json is missing"):
        load_run(run, root)


def test_missing_or_truncated_rank_file_is_refused(saved, tmp_path):
    root, directory = _copy(saved, tmp_path)
    run = build_run(ParallelConfig(), init=False)
    data = (directory / "rank_00000.pt").read_bytes()
    (directory / "rank_00000.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError, match=rf"rank_00000.pt has {len(data) // 2} bytes, meta.json recorded {len(data)}"
    ):
        load_run(run, root)
    (directory / "rank_00000.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rank_00000.pt is missing \(checkpoint written by 1 ranks\)"):
        load_run(run, root)


def test_optimizer_kind_mismatch_names_both_layouts(saved, tmp_path):
    root, _ = _copy(saved, tmp_path)
    run = build_run(ParallelConfig(distributed_optimizer=True), init=False)
    with pytest.raises(
        CheckpointError,
        match="distributed_optimizer=False; this run has .*distributed_optimizer=True.*may not",
    ):
        load_run(run, root)


def test_another_layout_loads_weights_and_says_rng_is_not_restored(saved, tmp_path, caplog):
    """A meta.json of a TP2 world (consistent, checksummed): weights load, RNG streams stay."""
    root, directory = _copy(saved, tmp_path)
    _, original = saved
    meta = json.loads((directory / "meta.json").read_text())
    meta["layout"].update(tensor_parallel=2)
    write_meta(directory / "meta.json", meta)
    run = build_run(ParallelConfig(), init=False)
    torch.manual_seed(5)
    expected_draw = torch.randn(3)
    torch.manual_seed(5)
    with caplog.at_level("WARNING", logger="megatron_gspo.checkpoint.load"):
        assert load_run(run, root)["step"] == 2
    assert torch.equal(torch.randn(3), expected_draw)  # the CPU generator was left alone
    assert "random streams are not restored" in caplog.text and "TP=2" in caplog.text
    a, b = original.model.state_dict(), run.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))
