"""A package's public names, imported from their modules on first use (PEP 562).

A package whose modules are imported on their own in light processes (the config check without
torch, the embedded server's start-up) names its entry points this way: importing one of its
modules does not import its siblings, as it did before they shared a package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list]]:
    """`__getattr__` and `__dir__` for `package`: each name of `exports` from the module it names."""

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    def __dir__() -> list:
        return sorted(exports)

    return __getattr__, __dir__
