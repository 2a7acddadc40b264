"""A TP2 x EP2 trainer (4 gloo ranks) streams its weights into the embedded rollout server."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from forked_torchrun import torchrun

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint

WORKER = Path(__file__).with_name("weight_sync_worker.py")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(2, 2), (1, 2)], ids=["tp2_ep2", "tp1_ep2"])
def test_trainer_syncs_into_the_embedded_server_and_only_rank0s_replica_gathers(tmp_path, tp, ep):
    checkpoint = make_tiny_hf_checkpoint(tmp_path / "hf", tiny(vocab_size=80, init_std=0.2))
    result = tmp_path / "result.json"
    colocated = ["--colocated"] if tp == 2 else []  # one layout: its gathers are the ones shared
    cmd = [
        *torchrun(4, WORKER),
        f"--tp={tp}", f"--ep={ep}", f"--checkpoint={checkpoint}", f"--result={result}", *colocated,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(result.read_text())
    for version, method in enumerate(("distributed", "tensor"), start=1):
        r = results[method]
        print(
            f"{method}: |server - trainer| max before {r['before']:.3e}, after {r['after']:.3e}; "
            f"{r['buckets']} buckets, {r['bytes']} bytes; bytes gathered per rank {r['gathered']}"
        )
        assert r["before"] > 1e-2  # the perturbation is visible: the check below can fail
        assert r["after"] <= 1e-5
        assert r["version"] == [str(version)]
        assert r["buckets"] > 3  # 50 KiB buckets: the model went in several
        # Ranks 0-1 hold data-parallel replica 0 and expert-data-parallel replica 0 (EP groups
        # {0, 1} and {2, 3}); ranks 2-3 hold replica 1 of the dense tensors and, at TP2 x EP2,
        # the same expert replica 0 (expert DP 1), at TP1 x EP2 expert replica 1 (expert DP 2).
        g = r["gathered"]
        assert g[0] == g[1] > 0
        if tp == 2:  # 2-3 gather the experts rank 0 needs, never the dense tensors
            assert 0 < g[2] == g[3] < g[0]
        else:  # nothing of 2-3 is on rank 0's path: no weight bytes move there
            assert g[2] == g[3] == 0
    if not colocated:
        return
    # Colocated: servers of TP 2 on devices 2-3 and 0-1 (listed in that order) each got, in every
    # request, TP rank r's entry from the shared memory of the trainer rank on its device.
    r = results["colocated"]
    print(f"colocated: |server - trainer| max {r['after']:.3e} over 2 servers; {r['buckets']} buckets")
    assert r["before"] > 1e-2 and r["after"] <= 1e-5 and r["version"] == ["3", "3"]
    pids = r["pids"]
    assert len(set(pids)) == 4 and len(r["handle_pids"]) == r["buckets"] > 3
    assert all(request == [[pids[2], pids[3]], [pids[0], pids[1]]] for request in r["handle_pids"])
    assert all(g > 0 for g in r["gathered"])  # every rank received the whole model, a tensor at a time
