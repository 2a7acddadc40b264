"""SGLang's own request/response contract types, loaded without importing SGLang.

`sglang/api/v1/api_types.py` is a generated, torch-free msgspec module; the real server
gates every /generate body through `GenerateRequest.from_json_value`. We load that file
by path from the installed wheel (installed with --no-deps on CPU machines) so the
embedded server and tests check the exact same contract. Absent SGLang, `load()` returns
None and callers skip the contract check (it is an extra check, not a dependency).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import pathlib
import sys
from types import ModuleType

_MODULE_NAME = "megatron_gspo_sglang_api_types"


@functools.cache
def load() -> ModuleType | None:
    """The `sglang.api.v1.api_types` module of the installed SGLang wheel, or None."""
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = pathlib.Path(str(dist.locate_file("sglang/api/v1/api_types.py")))
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE_NAME] = module  # msgspec resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def require() -> ModuleType:
    """Like `load()`, but a clear error when the contract is unavailable."""
    module = load()
    if module is None:
        raise RuntimeError(
            "SGLang's contract types are not installed; run `pip install --no-deps sglang==0.5.23`"
        )
    return module
