"""SGLang's CPU engine on a host without a GPU: the driver stand-in and two import-time fixes.

SGLang 0.5.23 serves on the CPU (`SGLANG_USE_CPU_ENGINE=1`, `--device cpu`) with PyPI's CUDA
build of torch, except for three things a GPU-less host trips on (docs/sglang-on-cpu.md):

1. `sgl_kernel`'s CUDA extension needs `libcuda.so.1` to load at all (one symbol). With no
   driver installed, `preload_driver_stand_in` loads the project's one-symbol stand-in under that
   soname first, so the dynamic loader resolves the extension's dependency to it.
2. and 3. are `FIXES`, applied as SGLang imports the module each names.

Loaded by the `.pth` file that launch/setup_sglang.sh installs into SGLang's environment, in every
process of that environment started with SGLANG_USE_CPU_ENGINE=1 (the server's spawned scheduler
too). It never acts where CUDA is available, and a SGLang version it was not verified against
gets no fix, with a warning that says so. Standard library only: it runs before anything else
is imported. tests/patches/test_sglang_cpu.py fails once SGLang no longer needs a fix.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

VERIFIED_SGLANG = "0.5.23"
DRIVER = "libcuda.so.1"


@dataclass(frozen=True)
class Fix:
    """One import-time fix of SGLang: the module it patches once imported, and why.

    `answers` are the lines of SGLang (path under the `sglang` package, 1-based line, the line's
    text stripped) that fail without the fix; tests/patches/test_sglang_cpu.py checks they are
    still there and still fail.
    """

    name: str
    module: str
    answers: tuple[tuple[str, int, str], ...]
    why: str
    apply: Callable[[object], None]


def _plain_cpu_host_buffers(module) -> None:
    def alloc_cpu(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        return allocator.allocate(dims, dtype=dtype, device=device)  # pinning needs a driver

    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_cpu


def _release_synchronizes_cpu(module) -> None:
    import torch

    device_module = torch.get_device_module

    def get_device_module(device=None):
        if device is None and not torch.cuda.is_available():
            return torch.cpu
        return device_module(device)

    torch.get_device_module = get_device_module


FIXES = (
    Fix(
        name="host_buffers_unpinned",
        module="sglang.srt.mem_cache.pool_host.common",
        answers=(
            ("srt/state_capturer/base.py", 67, "alloc = ALLOC_MEMORY_FUNCS[device]"),
            ("srt/state_capturer/base.py", 72, "pin_memory=True,"),
            ("srt/mem_cache/pool_host/common.py", 454, "lambda: alloc_with_host_register,"),
        ),
        why=(
            "--enable-return-routed-experts allocates its host buffer with pin_memory=True through "
            "ALLOC_MEMORY_FUNCS, a defaultdict whose default registers host memory with "
            "torch.cuda.cudart(): 'Found no NVIDIA driver' at start-up. A plain allocator for 'cpu'."
        ),
        apply=_plain_cpu_host_buffers,
    ),
    Fix(
        name="release_synchronizes_cpu",
        module="sglang.srt.managers.scheduler_components.weight_updater",
        answers=(
            (
                "srt/managers/scheduler_components/weight_updater.py",
                379,
                "torch.get_device_module().synchronize()",
            ),
        ),
        why=(
            "/release_memory_occupation ends with torch.get_device_module().synchronize(), which is "
            "torch.cuda on torch's CUDA build: the scheduler dies. torch.cpu where CUDA is absent."
        ),
        apply=_release_synchronizes_cpu,
    ),
)


def stand_in_path() -> str:
    """Where launch/setup_sglang.sh builds the driver stand-in: inside SGLang's environment."""
    return os.path.join(sys.prefix, "lib", "sglang-cpu", DRIVER)


def preload_driver_stand_in() -> str | None:
    """Load the stand-in as `libcuda.so.1` when no driver loads; returns its path, or None."""
    try:
        ctypes.CDLL(DRIVER, mode=ctypes.RTLD_GLOBAL)
        return None  # a real driver: nothing to stand in for
    except OSError:
        pass
    path = stand_in_path()
    if not os.path.exists(path):
        warnings.warn(f"no {DRIVER} and no stand-in at {path}: run launch/setup_sglang.sh", stacklevel=2)
        return None
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return path


def _sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_available() -> bool:
    import torch  # imported by SGLang before any module a fix patches

    return torch.cuda.is_available()


class _FixOnImport(importlib.abc.MetaPathFinder):
    """Runs a fix right after SGLang executes the module it names."""

    def __init__(self, fixes) -> None:
        self.fixes = {fix.module: fix for fix in fixes}
        self.applied: list[str] = []

    def find_spec(self, name, path, target=None):
        fix = self.fixes.get(name)
        if fix is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module, _execute=execute, _fix=fix):
            _execute(module)
            if not _cuda_available():
                _fix.apply(module)
                self.applied.append(_fix.name)

        spec.loader.exec_module = exec_module
        return spec


def install(fixes=FIXES) -> _FixOnImport | None:
    """Preload the driver stand-in and register the fixes; None where SGLang's version is unverified."""
    version = _sglang_version()
    if version != VERIFIED_SGLANG:
        warnings.warn(
            f"patches/sglang_cpu: verified for sglang {VERIFIED_SGLANG}, found {version}; no fix applied",
            stacklevel=2,
        )
        return None
    preload_driver_stand_in()
    finder = _FixOnImport(fixes)
    sys.meta_path.insert(0, finder)
    return finder


def installed() -> bool:
    """Whether some load of this file already registered the fixes (the .pth runs it by path)."""
    return any(type(finder).__name__ == _FixOnImport.__name__ for finder in sys.meta_path)


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and not installed():
    FINDER = install()
