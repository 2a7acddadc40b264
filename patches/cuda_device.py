"""`torch.cuda.current_device()` is megatron-core's device everywhere; on CPU it must be "cpu".

Router gating moves its weight to it, the global memory buffer and TP all-gather buffers
allocate on it. Without CUDA torch raises "Torch not compiled with CUDA enabled".
"""

import torch
from packaging.specifiers import SpecifierSet

from ._base import Patch, require


def _check() -> None:
    from megatron.core.transformer.moe import router

    require(hasattr(torch.cuda, "current_device"), "cuda_device", "torch.cuda.current_device missing")
    require(hasattr(router, "TopKRouter"), "cuda_device", "megatron router.TopKRouter missing")


def _apply() -> None:
    torch.cuda.current_device = lambda: "cpu"


PATCH = Patch(
    name="cuda_device",
    fixes="torch.cuda.current_device() used as the device for buffers and router weights",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="cpu",
    check=_check,
    apply=_apply,
)
