"""Both packing layouts and R3 replay into the THD row at TP2 with sequence parallelism (2 processes)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from forked_torchrun import torchrun

WORKER = Path(__file__).with_name("packing_worker.py")


@pytest.mark.multiprocess
def test_tp2_sequence_parallel_packing_equals_one_sample_per_row(tmp_path):
    out = tmp_path / "result"
    proc = subprocess.run(
        [*torchrun(2, WORKER), "--out", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"result.rank{r}.json").read_text()) for r in range(2)]
    print(f"\nTP2+SP max |packed - alone|: {results}")
    for r in results:
        assert r["thd_shape"] == [1, 10 + 14 + 6 + 12 + 8 + 12]  # each sequence padded to a multiple of 2
        assert r["mask"] < 1e-5 and r["thd"] < 1e-5
        assert r["r3_thd"] < 1e-5 < 1e-2 < r["r3_changes_result"]
