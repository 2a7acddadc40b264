"""Megatron-Core's import-time compiles, deferred: they cost every process and serve none on CPU.

`megatron/core/jit.py` sets `jit_fuser = torch.compile` for the ~15 modules that decorate a
function with it, and 0.19's `moe/router.py` decorates a method with `@torch.compile` itself.
That imports torch's inductor, ~0.6 s of CPU on 0.16 and ~1.1 s on 0.19, in every process that
imports megatron-core (each rank, each tool) whether or not a compiled function ever runs; and on
CPU the one that does run every step (`TopKRouter._apply_expert_bias`) is traced and compiled in
every rank for ~0.4 s more, to fuse nothing. While a `megatron.core` module executes,
`torch.compile` is `compile_on_first_call`: `torch.compile` on the function's first call when
CUDA is available (the same compiled function as before, made when first needed), the function
itself without CUDA, as the engine's other fusions are CUDA only (`model/engine.py`;
megatron-core's own `disable_jit_fuser` runs them so). Calls to `torch.compile` after import are
untouched.

Megatron-core's `timers.py` (and, on 0.16, its inference engine's context) also import wandb when
it is installed (`try: import wandb`), ~0.9 s of CPU in every process, for `Timers.write` to a wandb
writer and the inference engine's metrics, which this project never uses (its own metrics import
wandb where `logging.wandb` asks for it). While those modules execute, `import wandb` finds nothing,
as where wandb is not installed.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

PACKAGE = "megatron.core"
_COMPILE_OUTSIDE: list[Callable] = []  # `torch.compile` as it was outside megatron's imports
_NOT_IMPORTED_BY = {  # megatron module -> the optional import it goes without
    "megatron.core.timers": "wandb",
    "megatron.core.inference.contexts.dynamic_context": "wandb",  # megatron's own inference engine
    "megatron.core.inference.engines.dynamic_engine": "wandb",
}
_EXECUTING: list[str] = []  # the megatron-core modules executing, innermost last


def compile_on_first_call(fn: Callable | None = None, **options: Any) -> Callable:
    """`torch.compile(fn, **options)` made on the first call, or `fn` when CUDA is not available.

    A decorator with or without options, as `torch.compile` is.
    """
    if fn is None:
        return functools.partial(compile_on_first_call, **options)
    runs: Callable | None = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal runs
        if runs is None:
            import torch

            compile_ = _COMPILE_OUTSIDE[0] if torch.compile is compile_on_first_call else torch.compile
            runs = compile_(fn, **options) if torch.cuda.is_available() else fn
        return runs(*args, **kwargs)

    return call


class _DeferWhileMegatronImports(importlib.abc.MetaPathFinder):
    """Finds `megatron.core` modules as the other finders do.

    Each runs with `torch.compile` standing for `compile_on_first_call`.
    """

    def find_spec(self, name, path, target=None):
        if _EXECUTING and _NOT_IMPORTED_BY.get(_EXECUTING[-1]) == name:
            raise ModuleNotFoundError(f"{name!r} is not imported by {_EXECUTING[-1]}", name=name)
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            return None
        spec = _find_elsewhere(self, name, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader.exec_module = _deferring(spec.loader.exec_module)
        return spec


def _find_elsewhere(finder, name, path, target):
    for other in sys.meta_path:
        if other is not finder and hasattr(other, "find_spec"):
            spec = other.find_spec(name, path, target)
            if spec is not None:
                return spec
    return None


def _deferring(exec_module: Callable) -> Callable:
    def exec_deferring(module):
        import torch

        compile_before = torch.compile
        if compile_before is not compile_on_first_call:
            _COMPILE_OUTSIDE[:] = [compile_before]
        torch.compile = compile_on_first_call
        _EXECUTING.append(module.__name__)
        try:
            exec_module(module)
        finally:  # a module that imports another restores its own caller's value
            _EXECUTING.pop()
            torch.compile = compile_before

    return exec_deferring


def install() -> None:
    """Defer megatron-core's import-time costs; a no-op once megatron-core is imported."""
    if PACKAGE in sys.modules or any(isinstance(f, _DeferWhileMegatronImports) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferWhileMegatronImports())
