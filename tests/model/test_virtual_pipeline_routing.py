"""Routing replay under a virtual pipeline, keyed by (model chunk, micro-batch).

PP2 x 2 chunks of a 4-layer MoE (stage 0: layers 1 and 3, stage 1: layers 2 and 4, 1-based),
interleaved 1F1B with full activation recompute. What every router used in the replayed forward
and in its backward recompute equals the routes recorded for that chunk and micro-batch, token
for token and by checksum, while the perturbed routers left to themselves route many tokens
elsewhere (`vpp_routing_worker.py`).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
from forked_torchrun import torchrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).with_name("vpp_routing_worker.py")


def run_worker(out: Path, *extra: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*torchrun(2, WORKER), "--out", str(out), *extra], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("vpp_routing") / "result")


def test_each_chunk_holds_its_interleaved_global_layers(results):
    assert [[[layer["layer"] for layer in chunk] for chunk in r["chunks"]] for r in results] == [
        [[1], [3]],
        [[2], [4]],
    ]


def test_replay_uses_the_recorded_routes_per_chunk_and_micro_batch(results):
    for r in results:
        assert r["own_routing_differs"] > 0  # replay had work to do
        for chunk in r["chunks"]:
            for layer in chunk:
                assert layer["forwards"] == layer["recomputes"] == 4  # recompute really ran
                assert all(layer["forward_ok"]) and all(layer["recompute_ok"]), layer
                assert layer["forward_checksum"] == layer["recompute_checksum"] == layer["recorded_checksum"]


def test_replay_keyed_by_micro_batch_alone_is_caught(tmp_path):
    """Each chunk replaying the other chunk's routes of the same micro-batch: the checks see it."""
    for r in run_worker(tmp_path / "result", "--wrong-chunk"):
        layers = [layer for chunk in r["chunks"] for layer in chunk]
        assert not any(all(layer["forward_ok"]) for layer in layers)
        assert all(layer["forward_checksum"] != layer["recorded_checksum"] for layer in layers)
