"""`benchmarks/run.py --quick` writes RESULTS.md and results.json with every row (no timing asserted)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_run_module():
    spec = importlib.util.spec_from_file_location("benchmarks_run", REPO / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quick_run_writes_every_row(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "--out", str(tmp_path)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = load_run_module().ROWS
    report = (tmp_path / "RESULTS.md").read_text()
    payload = json.loads((tmp_path / "results" / "results.json").read_text())
    assert payload["quick"] is True
    assert [r["name"] for r in payload["rows"]] == [row.name for row in rows]
    for row, record in zip(rows, payload["rows"]):
        assert f"| {row.name} | {row.fmt(record['value'])} |" in report
        assert math.isfinite(record["value"]), record
        assert (record["met"] is None) == (row.op is None), record
    for key in ("cpu", "cores", "torch", "megatron-core", "commit"):
        assert payload["machine"][key] not in ("", None, 0), key
        assert f"- {key}: " in report
