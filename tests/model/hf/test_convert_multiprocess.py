import json
import os
import subprocess
from pathlib import Path

import pytest
from convert_worker import CASES, make_checkpoint
from forked_torchrun import torchrun

WORKER = Path(__file__).resolve().parents[2] / "convert_worker.py"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tp2_ep2_load_matches_transformers_and_export_is_bit_identical(tmp_path):
    for case, cfg in CASES.items():
        make_checkpoint(tmp_path / case, cfg, seed=4)
    result = tmp_path / "result.json"
    cmd = [
        *torchrun(4, WORKER),
        "--tp=2",
        "--ep=2",
        f"--work={tmp_path}",
        f"--result={result}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(result.read_text())
    poisoned = results.pop("poisoned")
    assert poisoned["unchanged"] and len(poisoned["outcomes"]) == 4
    assert all("decoder.final_layernorm.weight has NaN/inf" in o for o in poisoned["outcomes"]), poisoned
    assert results.keys() == {*CASES, "default@etp1"}
    for case, r in results.items():
        print(
            f"TP2xEP2 {case}: per-token |dlogprob| max={r['max']:.3e} mean={r['mean']:.3e}; "
            f"bytes read per rank {r['bytes_read']} of {r['checkpoint_bytes']}"
        )
        assert r["max"] <= 1e-4
        assert r["same_keys"] and r["unequal"] == []
        # Each rank reads half the experts and half of every TP-split tensor (experts whole at ETP=1).
        assert max(r["bytes_read"]) < (0.6 if "etp1" in case else 0.4) * r["checkpoint_bytes"]
