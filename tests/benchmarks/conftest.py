"""The end-to-end runs of the benchmark scripts (`slow` here) are marked `benchmark_script`.

They drive `benchmarks/*.py` (scripts of the repository, not of an installed stack) through
whole training runs; CI runs them on one Python / megatron-core stack only (`.ci/run`).
"""

import json
from pathlib import Path

import pytest
from reproduce_runs import run_reproduce

HERE = Path(__file__).parent


@pytest.fixture
def quick_report(tmp_path):
    """Runs `reproduce.py --quick <mode args> --jobs 1` in tmp_path; (its summary.json, its --out)."""

    def run(*mode_args: str) -> tuple[dict, Path]:
        out, work = tmp_path / "out", tmp_path / "work"
        done = run_reproduce("--quick", *mode_args, "--jobs", "1", "--out", str(out), "--work-dir", str(work))
        assert done.returncode == 0, done.stdout + done.stderr[-4000:]
        return json.loads((out / "summary.json").read_text()), out

    return run


def pytest_collection_modifyitems(items):
    for item in items:  # every item of the session: this hook is not limited to its directory
        if HERE in item.path.parents and item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.benchmark_script)
