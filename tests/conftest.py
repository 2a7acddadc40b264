"""Suite-wide markers: a test that starts several processes (torchrun, gloo) is also `slow`.

`pytest -m "not slow"` is the quick subset: every module, single-process tests of seconds.
"""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("multiprocess") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
