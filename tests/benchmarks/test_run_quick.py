"""`benchmarks/run.py --quick` writes RESULTS.md and results.json with every row (no timing asserted)."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from warm_python import python

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
        [*python(), str(REPO / "benchmarks" / "run.py"), "--quick", "--out", str(tmp_path)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,  # every benchmark once, several of them full training runs
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


def test_quick_results_never_overwrite_the_committed_ones():
    run = load_run_module()
    assert run.output_dir(None, quick=False) == REPO / "benchmarks"
    quick = run.output_dir(None, quick=True)
    assert quick == REPO / "benchmarks" / "quick"
    for path in (quick / "RESULTS.md", quick / "results" / "results.json", quick / "reproduce" / "x.md"):
        ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(path)])
        assert ignored.returncode == 0, f"{path} is not git-ignored"


def test_committed_results_hold_no_absolute_paths():
    committed = [REPO / "benchmarks" / "RESULTS.md", *(REPO / "benchmarks" / "results").rglob("*")]
    absolute = re.compile(r"""(?<![\w.~-])/(?:work|tmp|home|root|Users|private|var|mnt|opt)/""")
    for path in committed:
        if path.is_file() and path.suffix in (".md", ".json"):
            found = absolute.findall(path.read_text())
            assert not found, f"{path.relative_to(REPO)} holds absolute paths: {found[:3]}"
