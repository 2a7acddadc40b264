"""Checkpoint checksums: every file verified on load, a damaged one named, resume falls back."""

import hashlib
import json
import logging
import shutil

import pytest
import torch
from ckpt_common import build_run, load_run, save_run, train_step

from megatron_gspo.checkpoint.files import write_meta
from megatron_gspo.checkpoint.meta import CheckpointCorruptError, CheckpointError, read_meta
from megatron_gspo.checkpoint.steps import latest_step, list_steps, resumable_step
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed

LOGGER = "megatron_gspo.checkpoint.load"


def _ours(caplog) -> list:
    """The checkpoint module's records (megatron logs its own warnings, e.g. deprecations on 0.19)."""
    return [r for r in caplog.records if r.name == LOGGER]


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    init_distributed(ParallelConfig())
    yield
    destroy_distributed()


def _weights(run):
    return {k: v.detach().clone() for k, v in run.model.state_dict().items() if torch.is_tensor(v)}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _flip_byte(path, offset=None):
    """Invert one byte in the middle of a file (size unchanged: only the checksum can tell)."""
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """Checkpoints of steps 1, 2, 3 and the weights and trainer states saved in each."""
    root = tmp_path_factory.mktemp("three")
    run = build_run(ParallelConfig(), init=False)
    saved = {}
    for _ in range(3):
        train_step(run)
        save_run(run, root, keep_last=3)
        saved[run.step] = (_weights(run), run.trainer_state())
    return root, saved


@pytest.fixture
def root(three_steps, tmp_path):
    shutil.copytree(three_steps[0], tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_meta_records_each_files_sha256(three_steps):
    root, _ = three_steps
    directory = root / "step_00000003"
    meta = read_meta(directory)
    assert meta["format_version"] == 3 and meta["checksums"]["algorithm"] == "sha256"
    names = {"rank_00000.pt", "trainer_state.pt"}
    names |= {f"{sub}/{p.name}" for sub in ("dist", "model") for p in (directory / sub).iterdir()}
    assert set(meta["checksums"]["files"]) == set(meta["files"]) == names
    for name in names:  # recomputed independently from the bytes on disk
        assert meta["checksums"]["files"][name] == hashlib.sha256((directory / name).read_bytes()).hexdigest()
        assert meta["files"][name] == (directory / name).stat().st_size


@pytest.mark.parametrize(
    "name", ["rank_00000.pt", "trainer_state.pt", "dist/__0_0.distcp", "dist/.metadata", "model/config.json"]
)
def test_flipped_byte_is_named_and_nothing_is_loaded(root, three_steps, name):
    _flip_byte(root / "step_00000003" / name)
    run = build_run(ParallelConfig(), init=False)
    before = _weights(run)
    with pytest.raises(CheckpointCorruptError, match=rf"step_00000003/{name} is corrupt: its sha256 is"):
        load_run(run, root)
    assert _same(_weights(run), before)  # verified before any state was touched
    with pytest.raises(CheckpointCorruptError, match=rf"step_00000003/{name} is corrupt"):
        load_run(run, root, step=3)


def test_edited_meta_is_refused_as_corrupt(root):
    path = root / "step_00000003" / "meta.json"
    text = path.read_text()
    path.write_text(text.replace('"expert_parallel": 1', '"expert_parallel": 2'))  # looks like a layout
    run = build_run(ParallelConfig(), init=False)
    with pytest.raises(CheckpointCorruptError, match="meta.json is corrupt: its content does not match"):
        load_run(run, root)
    meta = json.loads(text)
    del meta["meta_checksum"]
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointCorruptError, match="needs `meta_checksum` and `checksums`"):
        load_run(run, root)


def test_resume_falls_back_to_the_newest_intact_checkpoint(root, three_steps, caplog):
    _, saved = three_steps
    _flip_byte(root / "step_00000003" / "rank_00000.pt")
    run = build_run(ParallelConfig(), init=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        state = load_run(run, root, fallback=True)
    assert state == saved[2][1] and state["step"] == 2
    assert _same(_weights(run), saved[2][0])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == LOGGER]
    assert len(warnings) == 3
    assert "step_00000003 is damaged and skipped" in warnings[0] and "rank_00000.pt is corrupt" in warnings[0]
    assert "moved damaged checkpoint step_00000003 aside to" in warnings[1]
    assert "resuming from step_00000002, the newest intact checkpoint" in warnings[2]
    # `latest` now names the checkpoint resumed from, so the run can save step 3 again; the
    # damaged one is kept aside, where `keep_last` does not count it.
    assert latest_step(root) == 2 and list_steps(root) == [1, 2]
    assert [p.name.split("-")[0] for p in root.glob("step_00000003.*")] == ["step_00000003.damaged"]
    run.load_trainer_state(state)
    train_step(run)
    save_run(run, root, keep_last=3)
    assert latest_step(root) == 3
    assert load_run(run, root)["step"] == 3


def test_every_checkpoint_damaged_is_an_error_naming_each(root):
    _flip_byte(root / "step_00000003" / "rank_00000.pt")
    _flip_byte(root / "step_00000002" / "trainer_state.pt")
    (root / "step_00000001" / "rank_00000.pt").write_bytes(b"x")
    run = build_run(ParallelConfig(), init=False)
    with pytest.raises(CheckpointCorruptError) as info:
        load_run(run, root, fallback=True)
    message = str(info.value)
    assert message.startswith(f"no intact checkpoint under {root}: ")
    assert "step_00000003: " in message and "step_00000003/rank_00000.pt is corrupt" in message
    assert "step_00000002/trainer_state.pt is corrupt" in message
    assert "step_00000001/rank_00000.pt has 1 bytes" in message
    assert latest_step(root) == 3  # nothing was changed


def test_intact_checkpoints_load_the_same_with_and_without_fallback(root, three_steps, caplog):
    _, saved = three_steps
    run = build_run(ParallelConfig(), init=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert load_run(run, root, fallback=True) == saved[3][1]
    assert not _ours(caplog) and _same(_weights(run), saved[3][0])
    assert load_run(run, root) == saved[3][1] and latest_step(root) == 3


def test_missing_newest_directory_and_unreadable_latest_fall_back(root, three_steps, caplog):
    _, saved = three_steps
    shutil.rmtree(root / "step_00000003")
    run = build_run(ParallelConfig(), init=False)
    with pytest.raises(CheckpointCorruptError, match="no checkpoint for step 3"):
        load_run(run, root)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert load_run(run, root, fallback=True)["step"] == 2
    assert "step_00000003 is damaged and skipped: no checkpoint for step 3" in _ours(caplog)[0].getMessage()
    (root / "latest").write_bytes(b"\xff\x00garbage")
    assert resumable_step(root) == 2  # what the trainer checks before it resumes
    with pytest.raises(CheckpointCorruptError, match="not a step_NNNNNNNN checkpoint directory"):
        load_run(run, root)
    assert load_run(run, root, fallback=True) == saved[2][1] and latest_step(root) == 2


def test_layout_mismatch_is_not_skipped_by_fallback(root):
    run = build_run(ParallelConfig(distributed_optimizer=True), init=False)
    with pytest.raises(CheckpointError, match="written with layout") as info:
        load_run(run, root, fallback=True)
    assert not isinstance(info.value, CheckpointCorruptError)


def test_older_and_unknown_format_versions_are_refused(root):
    path = root / "step_00000003" / "meta.json"
    meta = json.loads(path.read_text())
    run = build_run(ParallelConfig(), init=False)
    for version in (2, 7):  # 2: the per-rank format of one layout, before resharding
        del meta["meta_checksum"]
        write_meta(path, {**meta, "format_version": version})
        meta = json.loads(path.read_text())
        with pytest.raises(CheckpointError, match=rf"format version {version}, this code reads \[3\]"):
            load_run(run, root, fallback=True)


def test_dist_file_missing_from_meta_listing_is_named(root):
    path = root / "step_00000003" / "meta.json"
    meta = json.loads(path.read_text())
    dist_names = [name for name in meta["files"] if name.startswith("dist/")]
    for name in dist_names:
        del meta["files"][name], meta["checksums"]["files"][name]
    del meta["meta_checksum"]
    write_meta(path, meta)
    run = build_run(ParallelConfig(), init=False)
    with pytest.raises(CheckpointCorruptError, match="0 under dist/, expected"):
        load_run(run, root)
