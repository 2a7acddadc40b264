"""Megatron-core's compiled functions (`@jit_fuser`, 0.19's `@torch.compile` router method):
nothing compiled while megatron imports, compiled on the first call where CUDA is, the plain
function without CUDA; `torch.compile` itself untouched outside megatron's imports."""

import subprocess
import sys

import torch

from megatron_gspo.deferred_compile import compile_on_first_call


def test_megatron_imports_without_compiling_and_its_fused_functions_still_compute():
    probe = """
import sys
import torch
compiled = []  # what torch.compile is asked to compile while megatron imports
real_compile = torch.compile
def recording_compile(fn=None, **options):
    compiled.append(getattr(fn, "__qualname__", None))
    return real_compile(fn, **options) if fn is not None else real_compile(**options)
torch.compile = recording_compile
import megatron_gspo
from megatron.core import jit
from megatron.core.models.gpt import GPTModel  # every @jit_fuser module of a model
from megatron.core.transformer.moe import router
from megatron.core.transformer.utils import gelu_impl
assert jit.jit_fuser.__name__ == "compile_on_first_call", jit.jit_fuser
assert compiled == [], compiled  # 0.19 also decorates a router method with torch.compile itself
assert torch.compile is recording_compile
assert "torch._inductor.compile_fx" not in sys.modules  # the import it costs
x = torch.linspace(-3, 3, 7)
want = 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))
torch.testing.assert_close(gelu_impl(x), want, rtol=0, atol=0)
assert compiled.count("gelu_impl") == 0  # no CUDA here: the function itself ran
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_compiles_once_on_the_first_call_with_cuda(monkeypatch):
    made = []

    def fake_compile(fn, **options):
        made.append(options)
        return lambda x: fn(x) + 100

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    @compile_on_first_call(dynamic=False)
    def double(x):
        return 2 * x

    assert made == []  # nothing compiled at decoration
    assert double(1) == 102 and double(2) == 104
    assert made == [{"dynamic": False}]  # once


def test_runs_the_function_itself_without_cuda(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **options: (_ for _ in ()).throw(AssertionError))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    class Router:
        @compile_on_first_call
        def scale(self, x):
            return 3 * x

    assert Router().scale(2) == 6 and Router.scale.__name__ == "scale"


def test_megatron_goes_without_wandb_and_the_run_still_imports_the_real_one():
    probe = """
import sys
import megatron_gspo
import megatron.core, megatron.core.timers
from megatron.core.models.gpt import GPTModel
assert "wandb" not in sys.modules, "megatron-core imported wandb"
assert megatron.core.timers.wandb is None
import wandb  # as megatron_gspo.training.metrics does for logging.wandb
assert callable(wandb.init) and wandb.__file__.endswith("wandb/__init__.py")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
