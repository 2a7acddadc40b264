"""Expandable segments switched off around the allocation of what CUDA IPC shares, and back on.

torch's allocator settings are process-wide and can be read and set without a GPU, so the switch
runs for real here (on a CUDA device object: nothing is allocated). That the allocation inside
really lands in an ordinary segment a second process can open is a GPU case
(`tests/gpu/test_gpu_colocation.py`).
"""

import pytest
import torch

from megatron_gspo.weight_sync.ipc_allocation import (
    OFF,
    ON,
    allocator_settings,
    expandable_segments_on,
    outside_expandable_segments,
    set_allocator_settings,
)

CUDA = torch.device("cuda", 0)

pytestmark = pytest.mark.skipif(
    allocator_settings() is None, reason="this torch does not report its settings"
)


@pytest.fixture
def expandable():
    set_allocator_settings(ON)  # as launch/train_h100.sh starts the trainer
    yield
    set_allocator_settings(OFF)


@pytest.mark.parametrize(
    ("settings", "on"),
    [
        ("", False),
        ("expandable_segments:True", True),
        ("max_split_size_mb:128, expandable_segments:True", True),
        ("expandable_segments:True,expandable_segments:False", False),
        ("expandable_segments:False", False),
    ],
)
def test_the_settings_string_is_read_as_torch_reads_it(settings, on):
    assert expandable_segments_on(settings) is on


def test_a_cuda_bucket_is_allocated_with_expandable_segments_off_then_they_are_back_on(expandable):
    assert expandable_segments_on(allocator_settings())
    with outside_expandable_segments(CUDA):
        assert allocator_settings() == OFF
    assert allocator_settings() == ON


def test_an_error_inside_still_switches_them_back_on(expandable):
    with pytest.raises(RuntimeError, match="bucket failed"), outside_expandable_segments(CUDA):
        raise RuntimeError("bucket failed")
    assert allocator_settings() == ON


def test_nothing_is_switched_on_the_cpu_or_when_they_are_off(expandable):
    with outside_expandable_segments(torch.device("cpu")):
        assert allocator_settings() == ON
    set_allocator_settings(OFF)
    with outside_expandable_segments(CUDA):
        assert allocator_settings() == OFF
    assert allocator_settings() == OFF  # not turned on by the block: it was off before
