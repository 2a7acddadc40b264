"""Routing replay under PP2 with 1F1B and full activation recompute, keyed by micro-batch.

The routers' forward hooks file what each router actually used, in its forward and in its
backward recompute; every one must equal the routing given for that micro-batch and layer.
Random targets make the replay visible (the router would pick others); a replay keyed by the
last forwarded micro-batch (call order) must fail on the first stage, where 1F1B runs a
forward of the next micro-batch before each backward.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
from forked_torchrun import torchrun

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("pp_routing_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_routing") / "result"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*torchrun(2, WORKER), "--out", str(out)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def all_ok(check, micro_batches):
    for layer in check:
        assert layer["forwards"] == layer["recomputes"] == micro_batches  # recompute really ran
        assert all(layer["forward_ok"]) and all(layer["recompute_ok"]), layer


def test_each_stage_replays_its_own_global_layers(results):
    assert [r["keyed"]["layers"] for r in results] == [[1], [2]]


def test_keyed_replay_in_forward_and_recompute(results):
    for r in results:
        all_ok(r["keyed"]["check"], 4)


def test_call_order_replay_is_caught(results):
    first_stage = results[0]["wrong_key"]["check"][0]
    assert all(first_stage["forward_ok"])
    assert not all(first_stage["recompute_ok"])  # backward of i ran after the forward of i + 1


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_step_routing_replays_through_train_on_batch(results, mode):
    """2 mini-batches x 2 micro-batches after a heavy router perturbation."""
    for r in results:
        all_ok(r[mode]["check"], 4)
        assert r[mode]["own_routing_differs"] > 0
