"""The gloo control plane and the process-group timeouts (world of one, real groups)."""

import datetime
import math

import pytest
import torch
import torch.distributed as dist

from megatron_gspo.checkpoint import steps
from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.model import control_plane
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed


def _timeout(group) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


@pytest.fixture
def fresh_world():
    destroy_distributed()  # other modules may leave a world of one behind
    yield
    destroy_distributed()


def test_timeout_reaches_every_process_group(fresh_world):
    from megatron.core import parallel_state as ps

    init_distributed(ParallelConfig(timeout_minutes=7.5))
    control = control_plane.control_group()
    assert control is not dist.group.WORLD and dist.get_backend(control) == "gloo"
    assert _timeout(dist.group.WORLD) == datetime.timedelta(minutes=7.5)
    assert _timeout(control) == datetime.timedelta(minutes=7.5)
    # megatron's own groups take whole minutes: rounded up, never shorter.
    assert _timeout(ps.get_tensor_model_parallel_group()) == datetime.timedelta(minutes=8)


def test_default_timeout_is_hours_and_bad_values_are_refused():
    assert ParallelConfig().timeout_minutes == 120
    assert load_config(overrides=["parallel.timeout_minutes=240"]).parallel.timeout_minutes == 240
    for bad in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="parallel.timeout_minutes must be a finite number > 0"):
            ParallelConfig(timeout_minutes=bad)
    with pytest.raises(ConfigError, match="parallel.timeout_minutes"):
        load_config(overrides=["parallel.timeout_minutes=0"])


def test_control_helpers_use_the_control_group(fresh_world, monkeypatch):
    init_distributed(ParallelConfig())
    control = control_plane.control_group()
    calls = []

    def record(name):
        def fake(*args, group=None, **kwargs):
            calls.append((name, group))
            if name == "all_gather_object":
                args[0][:] = [args[1]] * len(args[0])

        return fake

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # take the multi-rank paths
    for name in ("broadcast_object_list", "all_gather_object", "barrier"):
        monkeypatch.setattr(dist, name, record(name))
    assert control_plane.broadcast_from_rank0({"a": 1}) == {"a": 1}
    assert control_plane.all_gather_objects("x") == ["x", "x"]
    control_plane.barrier()
    assert steps._broadcast((ValueError("kept"), "tmp"))[1] == "tmp"  # an error value, not raised
    with pytest.raises(RuntimeError, match="rollouts failed"):
        control_plane.on_rank0(lambda: (_ for _ in ()).throw(RuntimeError("rollouts failed")))
    names = [name for name, _ in calls]
    assert names == ["broadcast_object_list", "all_gather_object", "barrier"] + ["broadcast_object_list"] * 2
    assert all(group is control for _, group in calls)
