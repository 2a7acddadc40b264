"""A save that fills the disk: one named error, nothing half-written left, earlier checkpoints intact.

The disk is made full where the bytes leave the process: the write of megatron's `dist/` files
(in its forked writers) or of our own files raises ENOSPC, as `write(2)` does on a full disk.
"""

import errno
import os

import megatron.core.dist_checkpointing.strategies.filesystem_async as megatron_writer
import pytest
from ckpt_common import build_run, save_run, train_step

from megatron_gspo.checkpoint import files
from megatron_gspo.checkpoint.meta import CheckpointSpaceError
from megatron_gspo.checkpoint.steps import latest_step, list_steps, resumable_step
from megatron_gspo.errors import DiskFullError
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    init_distributed(ParallelConfig())
    yield
    destroy_distributed()


@pytest.fixture(scope="module")
def run():
    run = build_run(ParallelConfig(), init=False)
    train_step(run)
    return run


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["megatron dist files", "our rank file"])
def test_a_full_disk_is_one_named_error_and_leaves_no_temporary_directory(run, tmp_path, monkeypatch, where):
    root = tmp_path / "ckpt"
    run.step = 1
    save_run(run, root)  # intact
    run.step = 2
    if where == "megatron dist files":
        monkeypatch.setattr(megatron_writer, "_write_item", _full)
    else:
        monkeypatch.setattr(files._HashingWriter, "write", _full)
    with pytest.raises(CheckpointSpaceError) as raised:
        save_run(run, root)
    message = str(raised.value)
    assert isinstance(raised.value, DiskFullError) and "\n" not in message, message
    assert "no space left on device saving checkpoint step 2" in message and str(root) in message, message
    assert "MiB (step 1's size)" in message and "intact (step_00000001; latest: step_00000001)" in message
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    assert list_steps(root) == [1] and latest_step(root) == 1 and resumable_step(root) == 1
    monkeypatch.undo()
    save_run(run, root)  # space again: the same step saves
    assert latest_step(root) == 2
