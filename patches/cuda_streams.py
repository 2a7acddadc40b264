"""CUDA streams and events used for overlap become no-ops on CPU.

The alltoall token dispatcher creates `torch.cuda.Stream()` for its device-to-host copies
and records a `d2h_event`; DDP's grad buffers wait on `torch.cuda.default_stream()`.
On CPU everything runs in program order, so waiting and recording do nothing.
"""

import contextlib

import torch
from packaging.specifiers import SpecifierSet

from ._base import Patch, require


class _Event:
    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _Event()

    def synchronize(self):
        pass


_STREAM = _Stream()


def _check() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    require(
        hasattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream"),
        "cuda_streams",
        "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream missing",
    )


def _apply() -> None:
    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Event
    torch.cuda.current_stream = lambda *a, **k: _STREAM
    torch.cuda.default_stream = lambda *a, **k: _STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None


PATCH = Patch(
    name="cuda_streams",
    fixes="torch.cuda.Stream/Event/synchronize used for compute/communication overlap",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="cpu",
    check=_check,
    apply=_apply,
)
