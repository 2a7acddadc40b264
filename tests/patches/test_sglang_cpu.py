"""patches/sglang_cpu: SGLang's CPU engine on this GPU-less box, and each of its fixes still needed.

The "still needed" tests run the installed SGLang (launch/setup_sglang.sh's environment) without
the shim and expect the exact failure each piece exists for, at the SGLang lines it names. When
SGLang fixes one, its test fails: then drop the fix (or narrow VERIFIED_SGLANG).
"""

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from megatron_gspo.patches.sglang_cpu import gpuless
from megatron_gspo.rollout.sglang_launch import sglang_python, sglang_unavailable

# The probes run SGLang's environment (~15 s each to import SGLang); the finder's own tests do not.
slow = pytest.mark.slow
needs_sglang = pytest.mark.skipif(sglang_unavailable() is not None, reason=str(sglang_unavailable()))

NO_DRIVER = "Found no NVIDIA driver on your system"
PROBE = textwrap.dedent(
    """
    import json, sys
    out = {}
    try:
        import sgl_kernel  # noqa: F401 - its CUDA extension links libcuda.so.1
        out["sgl_kernel"] = "ok"
    except Exception as err:
        out["sgl_kernel"] = f"{type(err).__name__}: {err}"
    import torch
    from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS, HostTensorAllocator
    import sglang.srt.managers.scheduler_components.weight_updater  # noqa: F401
    try:  # as state_capturer/base.py allocates the routed experts' host buffer
        ALLOC_MEMORY_FUNCS["cpu"]((4, 2, 2), torch.int32, "cpu", True, HostTensorAllocator())
        out["host_buffer"] = "ok"
    except Exception as err:
        out["host_buffer"] = f"{type(err).__name__}: {err}"
    try:  # as weight_updater.py ends a release
        torch.get_device_module().synchronize()
        out["release_sync"] = "ok"
    except Exception as err:
        out["release_sync"] = f"{type(err).__name__}: {err}"
    out["applied"] = [f.applied for f in sys.meta_path if type(f).__name__ == "_FixOnImport"]
    import sglang
    out["sglang_dir"] = sglang.__path__[0]
    print("PROBE " + json.dumps(out))
    """
)


def _probe(cpu_engine: bool) -> dict:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    if cpu_engine:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    done = subprocess.run(
        [sglang_python(), "-c", PROBE], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("PROBE ") :])


@pytest.fixture(scope="module")
def without_shim() -> dict:
    return _probe(cpu_engine=False)


@pytest.fixture(scope="module")
def with_shim() -> dict:
    return _probe(cpu_engine=True)


@slow
@needs_sglang
def test_each_piece_is_still_needed(without_shim):
    assert "libcuda.so.1" in without_shim["sgl_kernel"]
    assert NO_DRIVER in without_shim["host_buffer"]
    assert NO_DRIVER in without_shim["release_sync"]
    assert without_shim["applied"] == []


@slow
@needs_sglang
def test_the_shim_fixes_each_in_the_cpu_engine(with_shim):
    assert with_shim["sgl_kernel"] == "ok"
    assert with_shim["host_buffer"] == "ok"
    assert with_shim["release_sync"] == "ok"
    assert with_shim["applied"] == [[fix.name for fix in gpuless.FIXES]]


@slow
@needs_sglang
@pytest.mark.parametrize("fix", gpuless.FIXES, ids=lambda fix: fix.name)
def test_each_fix_names_lines_sglang_still_has(fix, without_shim):
    root = Path(without_shim["sglang_dir"])
    for path, line, text in fix.answers:
        source = (root / path).read_text().splitlines()
        assert source[line - 1].strip() == text, f"sglang/{path}:{line} is now {source[line - 1]!r}"


def _fake_module(tmp_path, monkeypatch, name: str) -> gpuless.Fix:
    (tmp_path / f"{name}.py").write_text("VALUE = 'upstream'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return gpuless.Fix(name, name, (), "test", lambda module: setattr(module, "VALUE", "fixed"))


def _import_with(finder: gpuless._FixOnImport, name: str, monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    return __import__(name)


def test_a_fix_runs_after_its_module_and_never_where_cuda_is(tmp_path, monkeypatch):
    fix = _fake_module(tmp_path, monkeypatch, "shim_target_cpu")
    monkeypatch.setattr(gpuless, "_cuda_available", lambda: False)
    finder = gpuless._FixOnImport([fix])
    assert _import_with(finder, "shim_target_cpu", monkeypatch).VALUE == "fixed"
    assert finder.applied == ["shim_target_cpu"]

    fix = _fake_module(tmp_path, monkeypatch, "shim_target_gpu")
    monkeypatch.setattr(gpuless, "_cuda_available", lambda: True)
    finder = gpuless._FixOnImport([fix])
    assert _import_with(finder, "shim_target_gpu", monkeypatch).VALUE == "upstream"
    assert finder.applied == []


def test_an_unverified_sglang_gets_no_fix_and_a_warning(monkeypatch):
    monkeypatch.setattr(gpuless, "_sglang_version", lambda: "0.6.0")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gpuless.install() is None
    assert any("verified for sglang 0.5.23, found 0.6.0" in str(w.message) for w in caught)
    assert not gpuless.installed()
