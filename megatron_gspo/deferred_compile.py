"""Megatron-Core's `@jit_fuser` functions: compiled on their first call where CUDA is, eager without.

`megatron/core/jit.py` sets `jit_fuser = torch.compile`, and the ~15 modules that decorate a
function with it call `torch.compile` while they import. That imports torch's inductor, ~0.6 s
of CPU in every process that imports megatron-core (each rank, each tool) whether or not a
fused function ever runs; and on CPU the one that does run every step
(`TopKRouter._apply_expert_bias`) is traced and compiled in every rank for ~0.4 s more, to fuse
nothing. `install()` has `megatron.core.jit` hand out `compile_on_first_call` instead:
`torch.compile` on the function's first call when CUDA is available (the same compiled function
as before, made when first needed), the function itself without CUDA, as the engine's other
fusions are CUDA only (`model/engine.py`; megatron-core's own `disable_jit_fuser` runs them so).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

JIT_MODULE = "megatron.core.jit"


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

            runs = torch.compile(fn, **options) if torch.cuda.is_available() else fn
        return runs(*args, **kwargs)

    return call


class _DeferJitFuser(importlib.abc.MetaPathFinder):
    """Finds `megatron.core.jit` as usual and swaps its `torch.compile` once the module has run."""

    def find_spec(self, name, path, target=None):
        if name != JIT_MODULE:
            return None
        sys.meta_path.remove(self)  # one module, once; and `find_spec` below must not find us
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_defer(module):
            exec_module(module)
            import torch

            if module.jit_fuser is torch.compile:  # megatron may have chosen a no-op or jit.script
                module.jit_fuser = compile_on_first_call

        spec.loader.exec_module = exec_then_defer
        return spec


def install() -> None:
    """Make `megatron.core.jit.jit_fuser` `compile_on_first_call`; a no-op once it is imported."""
    if JIT_MODULE in sys.modules or any(isinstance(f, _DeferJitFuser) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferJitFuser())
