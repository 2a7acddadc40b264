"""Hard-coded `device="cuda"` tensors and `.cuda()` calls are created on CPU instead.

Megatron's optimizer (found-inf flags, loss scale, grad-norm buffers), DDP grad buffers,
`get_default_causal_mask` and `tensor_parallel/data.py` allocate with `device="cuda"` or
call `.cuda()`, and `clip_grads` / the fp32 optimizer assert
`param.grad.type() == "torch.cuda.FloatTensor"`. A torch function mode, entered once per
process on the main thread, rewrites those device arguments to CPU and reports CPU float
tensors with their CUDA type names. It only touches calls that name a CUDA device.
"""

import inspect

import torch
from packaging.specifiers import SpecifierSet

from ._base import Patch, require


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Maps device="cuda" / .cuda() / .to("cuda") to CPU; Tensor.type() reports torch.cuda.* names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(arg) else arg for arg in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") else name
        return func(*args, **kwargs)


_MODE: CudaToCpuMode | None = None


def _check() -> None:
    from megatron.core.optimizer import clip_grads

    source = inspect.getsource(clip_grads)
    require("torch.cuda.FloatTensor" in source, "cuda_tensors_to_cpu", "clip_grads no longer checks types")


def _apply() -> None:
    global _MODE
    if _MODE is None:
        _MODE = CudaToCpuMode()
        _MODE.__enter__()


PATCH = Patch(
    name="cuda_tensors_to_cpu",
    fixes="optimizer / DDP / causal-mask code allocates on device='cuda' and asserts cuda tensor types",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="cpu",
    check=_check,
    apply=_apply,
)
