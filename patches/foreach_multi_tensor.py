"""Megatron's fallback multi-tensor ops use torch's foreach kernels instead of a Python loop.

Without apex or TransformerEngine, megatron's grad norm, grad clipping and param copies fall
back to `local_multi_tensor_l2_norm` (one `torch.norm` per tensor, then a list of 0-d tensors
turned into a tensor element by element) and `local_multi_tensor_scale` (one `copy_(src *
scale)` per tensor). Each optimizer step calls them over every parameter, under the
CUDA-to-CPU function mode that intercepts each call: on the tiny demo model that was 3.6 ms
of a 7 ms optimizer step. The replacements compute the same values with one foreach kernel
per list. A speed patch, not a fix: nothing fails without it. Left alone when apex or TE
provide the ops.
"""

import torch
from packaging.specifiers import SpecifierSet

from ._base import Patch, require


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """`amp_C.multi_tensor_l2norm`'s contract: the l2 norm of all tensors as a [1] fp32 tensor."""
    del chunk_size, noop_flag, per_tensor, args
    tensors = tensor_lists[0]
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack(norms).float())
    return total.reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """`amp_C.multi_tensor_scale`'s contract: dst = src * scale, list by list."""
    del chunk_size, noop_flag
    sources, destinations = tensor_lists[0], tensor_lists[1]
    if not sources:
        return
    if sources is destinations:
        torch._foreach_mul_(destinations, scale)
    else:
        torch._foreach_copy_(destinations, torch._foreach_mul(sources, scale))


def _fallback_in_use() -> bool:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    return (
        clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
        and clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale
        and optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale
    )


def _check() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    sites = {clip_grads: ("l2_norm_impl", "multi_tensor_scale_impl"), optimizer: ("multi_tensor_scale_impl",)}
    for module, names in sites.items():
        for name in names:
            require(hasattr(module, name), "foreach_multi_tensor", f"{module.__name__}.{name} is gone")
    require(
        hasattr(utils, "local_multi_tensor_l2_norm") and hasattr(utils, "local_multi_tensor_scale"),
        "foreach_multi_tensor",
        "megatron.core.utils no longer defines the local multi-tensor fallbacks",
    )


def _apply() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    if not _fallback_in_use():  # apex provides the ops
        return
    clip_grads.l2_norm_impl = foreach_l2_norm
    clip_grads.multi_tensor_scale_impl = foreach_scale
    optimizer.multi_tensor_scale_impl = foreach_scale


PATCH = Patch(
    name="foreach_multi_tensor",
    fixes="(speed) megatron's local multi-tensor fallbacks loop over tensors in Python",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="no_te",
    check=_check,
    apply=_apply,
    speed_only=True,
)
