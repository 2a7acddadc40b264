"""The end-to-end runs of the benchmark scripts (`slow` here) are marked `benchmark_script`.

They drive `benchmarks/*.py` (scripts of the repository, not of an installed stack) through
whole training runs; CI runs them on one Python / megatron-core stack only (`.ci/run`).
"""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:  # every item of the session: this hook is not limited to its directory
        if HERE in item.path.parents and item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.benchmark_script)
