"""The command the project runs its own Python programs with, as separate processes.

This interpreter (`sys.executable`), or `$MEGATRON_GSPO_PYTHON` split as a shell would: a wrapper
such as `numactl --cpunodebind=1 python` or `nsys profile -o run python`. It starts the embedded
rollout servers, the export a checkpoint option runs, and the benchmark scripts' training runs.
The test suite points it at a pre-imported interpreter to fork them from (tests/warm_python.py).
"""

from __future__ import annotations

import os
import shlex
import sys

PYTHON_VAR = "MEGATRON_GSPO_PYTHON"


def python_command() -> list[str]:
    """The argv prefix that runs a Python program of this project (`[*python_command(), "-m", ...]`)."""
    return shlex.split(os.environ.get(PYTHON_VAR, "")) or [sys.executable]
