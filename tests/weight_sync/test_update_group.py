"""The weight-update group's timeouts: NCCL's watchdog must not act before the project's deadline.

Under NCCL, torch's watchdog ends the process when a collective outlives the group's timeout
(TORCH_NCCL_ASYNC_ERROR_HANDLING=3 by default), so a group timeout equal to
weight_sync.timeout_s would kill the trainer before its own recovery (abort, set aside, retry).
No NCCL group can be made on CPU: the NCCL values are checked as computed and as handed to the
group constructor; the gloo group is made for real.
"""

import concurrent.futures as cf
import datetime
import threading
import time

import pytest
import torch

from megatron_gspo.config import WeightSyncConfig
from megatron_gspo.model.config import tiny
from megatron_gspo.weight_sync import distributed
from megatron_gspo.weight_sync.sync import WeightSync
from megatron_gspo.weight_sync.update_group import (
    NCCL_ABORT_MARGIN_S,
    abort_update_group,
    collective_timeout_s,
    free_port,
    init_update_group,
    join_watching,
    pick_backend,
)

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize(
    ("trainer", "devices", "expected"),
    [
        (CUDA, ["cuda", "cuda"], "nccl"),
        (CUDA, ["cuda", "cpu"], "gloo"),  # one CPU server would refuse NCCL
        (CUDA, [None], "gloo"),  # a server that does not say where it runs
        (CPU, ["cuda"], "gloo"),
    ],
)
def test_auto_picks_nccl_only_between_a_cuda_trainer_and_cuda_servers(trainer, devices, expected):
    infos = [{} if device is None else {"device": device} for device in devices]
    assert pick_backend("auto", trainer, infos) == expected
    assert pick_backend("nccl", CPU, infos) == "nccl"  # a chosen backend is kept (and refused by name)


def test_a_refusal_ends_the_rendezvous_wait_at_once_with_the_servers_message():
    # A real gloo rendezvous for two ranks whose second never comes: the store would wait 30 s.
    port = free_port()
    join = lambda: init_update_group(  # noqa: E731
        master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
        group_name="refused_probe", backend="gloo", timeout_s=30.0,
    )  # fmt: skip
    answers = cf.Future()
    threading.Timer(
        0.2, answers.set_exception, [RuntimeError("server: backend='nccl' needs a CUDA device")]
    ).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        join_watching(join, answers, timeout_s=30.0)
    assert time.monotonic() - start < 2.0


def test_the_join_returns_the_group_once_both_sides_are_done_and_times_out_otherwise():
    join = lambda: init_update_group(  # noqa: E731
        master_address="127.0.0.1", master_port=0, rank=0, world_size=1,
        group_name="joined_probe", backend="gloo", timeout_s=5.0,
    )  # fmt: skip
    answered = cf.Future()
    answered.set_result([{"success": True}])
    group = join_watching(join, answered, timeout_s=5.0)
    abort_update_group(group)
    silent = cf.Future()  # a server that never answers
    with pytest.raises(TimeoutError, match="timeout_s=0.3"):
        join_watching(lambda: object(), silent, timeout_s=0.3)

    def failing_join():
        raise RuntimeError("ProcessGroupNCCL is only supported with GPUs")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="only supported with GPUs"):  # the trainer's own failure, at once
        join_watching(failing_join, cf.Future(), timeout_s=30.0)
    assert time.monotonic() - start < 2.0


def test_nccl_collectives_outlive_the_deadline_and_gloo_keeps_it():
    assert collective_timeout_s("nccl", 600.0) == 600.0 + NCCL_ABORT_MARGIN_S
    assert NCCL_ABORT_MARGIN_S >= 60  # room for the next bucket's gather and the abort itself
    assert collective_timeout_s("gloo", 600.0) == 600.0  # no watchdog: gloo's timeout releases a held receive


def test_the_group_is_built_with_the_collective_timeout():
    group = init_update_group(
        master_address="127.0.0.1",
        master_port=0,  # a world of one: any free port
        rank=0,
        world_size=1,
        group_name="timeout_probe",
        backend="gloo",
        timeout_s=5.0,
        collective_timeout=65.0,
    )
    try:
        assert group._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(seconds=65)
    finally:
        abort_update_group(group)
    assert group not in torch.distributed.distributed_c10d._world.pg_map  # aborted and forgotten


class _Servers:
    """What `WeightSync._ensure_group` asks of the client, for one TP-2 server that joins at once."""

    urls = ["http://127.0.0.1:30000"]

    def server_info(self):
        return [{"tp_size": 2, "dp_size": 1}]

    def init_weights_update_group(self, **kwargs):
        self.asked = kwargs
        done = cf.Future()
        done.set_result([{"success": True}])
        return done


def test_the_trainer_gives_an_nccl_group_more_than_the_deadline(monkeypatch):
    made = {}

    def fake_init_update_group(**kwargs):  # no NCCL on CPU: what the trainer asks for is the point
        made.update(kwargs)
        return object()

    monkeypatch.setattr(distributed, "init_update_group", fake_init_update_group)
    cfg = WeightSyncConfig(backend="nccl", timeout_s=120.0, master_port=29999)
    sync = WeightSync(cfg, torch.nn.Linear(1, 1), tiny(vocab_size=80), export_dir=None)
    servers = _Servers()
    sync._ensure_group(servers)
    assert servers.asked["backend"] == "nccl" and made["backend"] == "nccl" and made["world_size"] == 3
    assert made["timeout_s"] == 120.0  # the rendezvous: the project's own wait
    assert made["collective_timeout"] == collective_timeout_s("nccl", 120.0) > 120.0  # the watchdog's


class _HungBroadcast:
    """A broadcast that never completes, as an NCCL one to a peer that left."""

    def is_completed(self):
        return False


@pytest.mark.parametrize(("backend", "aborted"), [("nccl", True), ("gloo", False)])
def test_a_refused_bucket_aborts_an_nccl_group_at_once(monkeypatch, backend, aborted):
    # Under NCCL a broadcast left in flight by a refusal would run into the watchdog: the trainer
    # aborts the group before draining the stream. A gloo group is destroyed after the release.
    calls = []
    monkeypatch.setattr(distributed, "abort_update_group", calls.append)
    sync = WeightSync(
        WeightSyncConfig(backend=backend, timeout_s=60.0), torch.nn.Linear(1, 1), tiny(vocab_size=80), None
    )
    group = object()
    sync._group = distributed._Group(group, "g", ["http://127.0.0.1:30000"], backend)
    refused = cf.Future()
    refused.set_exception(RuntimeError("bucket refused"))
    bucket = distributed.Bucket(index=3, names=["w"], nbytes=4)
    with pytest.raises(distributed.WeightSyncFailed, match="bucket 3 .*bucket refused"):
        sync._finish(bucket, torch.zeros(1), _HungBroadcast(), refused)
    assert (calls == [group]) is aborted and sync._group.aborted is aborted
