"""Running `benchmarks/reproduce.py` from the tests, as a user would."""

import os
import subprocess
from pathlib import Path

from warm_python import python

REPRODUCE = Path(__file__).resolve().parents[2] / "benchmarks" / "reproduce.py"


def run_reproduce(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`benchmarks/reproduce.py` with `args`, one thread per training, its output captured."""
    return subprocess.run(
        [*python(), str(REPRODUCE), *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
