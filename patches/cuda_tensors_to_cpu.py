"""Hard-coded `device="cuda"` tensors and `.cuda()` calls are created on CPU instead.

Megatron's optimizer (found-inf flags, grad-norm buffers), `dist_checkpointing` (the fully
parallel load's exchanges) and the default causal masks allocate with `device="cuda"`, and
`clip_grads` / the fp32 optimizer assert `param.grad.type() == "torch.cuda.FloatTensor"`. A
torch function mode rewrites those device arguments to CPU and reports CPU float tensors
with their CUDA type names; it only touches calls that name a CUDA device.

The mode is entered only where those calls live: the methods of megatron's optimizer classes
(construction, state dicts), the `clip_grads` functions, `dist_checkpointing.save` / `load`,
the default attention masks and `LanguageModule.setup_embeddings_and_output_layer` (with tied
embeddings under pipeline parallelism it moves the last stage's copy of the embedding to
`.cuda()` before syncing it with the first stage's). The optimizer methods every step runs
(`step`, grad preparation and zeroing, grad norm, clipping) stay outside it and reach CUDA only
through the clip_grads functions, which enter it: a mode intercepts every torch call made under
it (about 1 us each), and held for the whole process it cost about a fifth of a tiny model's
RL step. Other CUDA-only spots on megatron-core's CPU paths have their own patches
(`cuda_device`, `cuda_streams`, `rng_tracker`, `schedule_token_counter`).
"""

import functools
import inspect
import threading

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


_ACTIVE = threading.local()
# Methods that run every optimizer step and allocate nothing on CUDA themselves: `step` and
# `step_with_ready_grads` run Adam's per-parameter math; the grad-norm, clipping and zero-count
# methods reach CUDA only through the clip_grads functions, which enter the mode on their own.
_UNWRAPPED = (
    "step",
    "step_with_ready_grads",
    "prepare_grads",
    "zero_grad",
    "get_main_grads_for_grad_norm",
    "get_grad_norm",
    "clip_grad_norm",
    "count_zeros",
)
_CLIP_GRADS_FUNCTIONS = ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32")
_MASK_FUNCTIONS = ("get_default_causal_mask", "get_sliding_window_causal_mask")


def _under_mode(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if getattr(_ACTIVE, "on", False):  # one mode at a time: nested modes would each intercept
            return method(*args, **kwargs)
        _ACTIVE.on = True
        try:
            with CudaToCpuMode():
                return method(*args, **kwargs)
        finally:
            _ACTIVE.on = False

    wrapper.__cuda_to_cpu__ = True
    return wrapper


def _optimizer_classes() -> list[type]:
    """MegatronOptimizer and its subclasses in megatron's optimizer modules (distributed one included)."""
    from megatron.core.optimizer import distrib_optimizer, optimizer

    found = {optimizer.MegatronOptimizer}
    for module in (optimizer, distrib_optimizer):
        classes = (cls for cls in vars(module).values() if inspect.isclass(cls))
        found.update(cls for cls in classes if issubclass(cls, optimizer.MegatronOptimizer))
    return sorted(found, key=lambda cls: cls.__qualname__)


def _check() -> None:
    from megatron.core.optimizer import clip_grads

    source = inspect.getsource(clip_grads)
    require("torch.cuda.FloatTensor" in source, "cuda_tensors_to_cpu", "clip_grads no longer checks types")
    require(len(_optimizer_classes()) >= 4, "cuda_tensors_to_cpu", "megatron optimizer classes not found")
    for name in _CLIP_GRADS_FUNCTIONS:
        require(hasattr(clip_grads, name), "cuda_tensors_to_cpu", f"clip_grads.{name} missing")
    from megatron.core import dist_checkpointing

    for name in ("save", "load"):
        require(hasattr(dist_checkpointing, name), "cuda_tensors_to_cpu", f"dist_checkpointing.{name}")
    from megatron.core.transformer import utils

    for name in _MASK_FUNCTIONS:
        require(hasattr(utils, name), "cuda_tensors_to_cpu", f"transformer.utils.{name}")
    from megatron.core.models.common.language_module.language_module import LanguageModule

    require(
        hasattr(LanguageModule, "setup_embeddings_and_output_layer"),
        "cuda_tensors_to_cpu",
        "LanguageModule.setup_embeddings_and_output_layer missing",
    )


def _functions_to_wrap() -> list[tuple[object, str]]:
    """(module or class, name) of the functions that run under the mode."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.transformer import utils

    # ChainedOptimizer.step calls the clip_grads functions directly (optimizer.py holds its own
    # references); dist_checkpointing's exchanges and the fully parallel load allocate on CUDA.
    found = [(module, name) for name in _CLIP_GRADS_FUNCTIONS for module in (clip_grads, optimizer)]
    found += [(module, name) for name in ("save", "load") for module in (dist_checkpointing, serialization)]
    # The local attention's softmax builds its default masks (no attention_mask given) on CUDA.
    found += [(module, name) for name in _MASK_FUNCTIONS for module in (utils, fused_softmax)]
    found.append((LanguageModule, "setup_embeddings_and_output_layer"))  # tied embeddings under PP
    return [(module, name) for module, name in found if hasattr(module, name)]


def _apply() -> None:
    wrapped: dict[int, object] = {}  # one wrapper per function, whichever module refers to it
    for module, name in _functions_to_wrap():
        function = getattr(module, name)
        if getattr(function, "__cuda_to_cpu__", False):
            continue
        setattr(module, name, wrapped.setdefault(id(function), _under_mode(function)))
    for cls in _optimizer_classes():
        for name, member in list(vars(cls).items()):
            if name in _UNWRAPPED or getattr(member, "__cuda_to_cpu__", False):
                continue
            if inspect.isfunction(member):
                setattr(cls, name, _under_mode(member))


PATCH = Patch(
    name="cuda_tensors_to_cpu",
    fixes="optimizer / DDP / causal-mask code allocates on device='cuda' and asserts cuda tensor types",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="cpu",
    check=_check,
    apply=_apply,
)
