"""SIGTERM as `megatron-gspo train` handles it: SystemExit(143), never lost, never mid-protocol.

A SystemExit raised by the handler inside an at-fork hook or a `__del__` is dropped by Python;
the recorded signal raises it again at the next check. Delivered right after a bucket was
announced to the server and before the trainer's broadcast, the exit would leave the server
waiting in its receive (holding its weight-update lock), and the unwinding trainer would wait on
it: its abort of the session queues behind the receive until the client's timeout.
"""

import signal
import sys

import pytest

from megatron_gspo import termination
from megatron_gspo.config import WeightSyncConfig
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.model.hf.convert import load_hf_checkpoint
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.termination import exit_if_terminated, exit_on_sigterm, protocol_step
from megatron_gspo.weight_sync.sync import WeightSync

CFG = tiny(vocab_size=80)
CLIENT_TIMEOUT_S = 15.0


@pytest.fixture
def sigterm_exits(monkeypatch):
    monkeypatch.setattr(termination, "_received", [])  # this test's signals stay in this test
    previous = signal.getsignal(signal.SIGTERM)
    exit_on_sigterm()
    yield
    signal.signal(signal.SIGTERM, previous)


class SignalledWhileCollected:
    """Receives SIGTERM inside `__del__`, where Python prints and drops the handler's SystemExit
    (as in logging's at-fork hook while a checkpoint save forks its writers)."""

    def __del__(self):
        signal.raise_signal(signal.SIGTERM)


def test_an_exit_dropped_where_the_signal_landed_is_raised_at_the_next_check(sigterm_exits, monkeypatch):
    exit_if_terminated()  # nothing received: nothing to do
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))
    SignalledWhileCollected()  # collected at once (no reference left)
    assert dropped == [SystemExit]  # what Python reports as "Exception ignored in ..."
    with pytest.raises(SystemExit) as exited:
        exit_if_terminated()
    assert exited.value.code == 128 + signal.SIGTERM


def test_sigterm_waits_for_an_open_protocol_step(sigterm_exits):
    done = []
    with pytest.raises(SystemExit) as exited:
        with protocol_step():
            signal.raise_signal(signal.SIGTERM)
            done.append("the rest of the step")
    assert exited.value.code == 128 + signal.SIGTERM and done == ["the rest of the step"]
    with pytest.raises(SystemExit):  # outside a step: at once
        signal.raise_signal(signal.SIGTERM)
        done.append("never")
    assert done == ["the rest of the step"]


@pytest.mark.slow  # an embedded server and a weight sync: 12-23 s
def test_sigterm_right_after_a_bucket_is_announced(sigterm_exits, tmp_path, monkeypatch):
    checkpoint = make_tiny_hf_checkpoint(tmp_path / "hf", CFG)
    init_distributed(ParallelConfig(), seed=0)
    try:
        model = build_model(CFG, ParallelConfig()).eval()
        load_hf_checkpoint(model, checkpoint, CFG)
        with launch_embedded_server(checkpoint) as server:
            with SGLangClient([server.url], max_retries=0, timeout_s=CLIENT_TIMEOUT_S) as client:
                config = WeightSyncConfig(timeout_s=60, release_timeout_s=CLIENT_TIMEOUT_S)
                sync = WeightSync(config, model, CFG, tmp_path / "export")
                sync.sync(client, 1)  # the group is joined
                announce = client.update_weights_from_distributed

                announced = []

                def announce_then_sigterm(*args, **kwargs):
                    announced.append(announce(*args, **kwargs))  # the server now waits for the broadcast
                    signal.raise_signal(signal.SIGTERM)
                    return announced[-1]

                end = client.end_weight_update
                ends = []  # what the unwinding's abort of the session got: answers, or the error

                def end_and_record(*args, **kwargs):
                    try:
                        ends.append(end(*args, **kwargs))
                    except Exception as err:
                        ends.append(f"{type(err).__name__}: {err}")
                        raise
                    return ends[-1]

                monkeypatch.setattr(client, "update_weights_from_distributed", announce_then_sigterm)
                monkeypatch.setattr(client, "end_weight_update", end_and_record)
                with pytest.raises(SystemExit):
                    sync.sync(client, 2)
                monkeypatch.undo()
                # The abort was answered, not queued behind a receive until its timeout (the hang
                # guard, release_timeout_s) ...
                assert len(ends) == 1 and isinstance(ends[0], list) and ends[0][0]["success"], ends
                # ... since the broadcast went out: the server received the bucket, and answers a new sync.
                announced[0].result(timeout=10)
                sync.sync(client, 3)
                assert client.model_info()[0]["weight_version"] == "3"
                sync.close(client)
    finally:
        destroy_distributed()
