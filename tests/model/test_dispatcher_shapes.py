"""Micro-batches are padded to their expert-parallel peers' shape only under allgather."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from forked_torchrun import torchrun

WORKER = Path(__file__).with_name("dispatcher_shape_worker.py")


@pytest.mark.multiprocess
def test_alltoall_keeps_each_ranks_shape_and_allgather_pads_to_the_largest():
    cmd = torchrun(2, WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    rows = json.loads(line)
    shapes = {(r["dispatcher"], r["layout"], r["rank"]): (r["own"], r["padded"]) for r in rows}
    assert len(shapes) == 8
    # rank 0 packs 5 + 9 + 3 tokens, rank 1 packs 17 + 4
    assert shapes["alltoall", "thd", 0] == ([1, 17], [1, 17])
    assert shapes["alltoall", "thd", 1] == ([1, 21], [1, 21])
    assert shapes["allgather", "thd", 0] == ([1, 17], [1, 21])
    assert shapes["allgather", "thd", 1] == ([1, 21], [1, 21])
    for rank in (0, 1):
        own, padded = shapes["alltoall", "mask", rank]
        assert padded == own
    own0, padded0 = shapes["allgather", "mask", 0]
    own1, padded1 = shapes["allgather", "mask", 1]
    assert own0 != own1
    assert padded0 == padded1 == [max(own0[0], own1[0]), max(own0[1], own1[1])]
