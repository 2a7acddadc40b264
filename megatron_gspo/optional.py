"""Packages outside the core install (pyproject.toml's extras), imported where a run needs them.

`pip install megatron-gspo` trains and serves the built-in tasks from .jsonl data;
`megatron-gspo[full]` adds TensorBoard, math rewards, Parquet / `save_to_disk` data and the
tools' figures. A missing one fails with the extra that installs it, not a bare import error.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# import name -> (distribution, extra that installs it)
EXTRAS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "math_verify": ("math-verify", "math"),
    "datasets": ("datasets", "data"),
    "matplotlib": ("matplotlib", "plots"),
    "wandb": ("wandb", "wandb"),
}


def missing_message(module: str, purpose: str) -> str:
    """The error text for `purpose` lacking `module` (a key of `EXTRAS`)."""
    dist, extra = EXTRAS[module]
    return f"{purpose} needs the {dist} package, not installed: pip install 'megatron-gspo[{extra}]'"


def installed(module: str) -> bool:
    """Whether `module` (a key of `EXTRAS`) can be imported, without importing it."""
    return importlib.util.find_spec(module) is not None


def require(module: str, purpose: str) -> ModuleType:
    """Import `module` (a key of `EXTRAS`); ModuleNotFoundError naming its extra when it is missing."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module:  # the package is there but one of its own imports failed
            raise
        raise ModuleNotFoundError(missing_message(module, purpose), name=module) from None
