"""Megatron's grad norm and grad clipping run as plain CPU code instead of under the CUDA-to-CPU mode.

`clip_grads.get_grad_norm_fp32` and `clip_grad_by_total_norm_fp32` touch CUDA in two lines
only: a `torch.zeros(1, device="cuda")` scratch flag and an assert that every grad is a
`torch.cuda.FloatTensor`. For those, `cuda_tensors_to_cpu` runs them under its torch function
mode, which routes every torch call inside through Python; each `to_local_if_dtensor`
(a `torch.no_grad()` per parameter) then costs ~10 us, about 1.2 ms per optimizer step on the
demo model, 4 steps per RL step. The replacements do the same arithmetic with the same
multi-tensor ops (`clip_grads.multi_tensor_applier` with megatron's own `l2_norm_impl` /
`multi_tensor_scale_impl`) on CPU: equal results, tested against the mode path.

Only the plain case is replaced: an L2 norm over plain fp32 tensors and clipping by a float
norm from `.grad`. Anything else (inf or other p-norms, DTensor grads, `decoupled_grad`, a
tensor-valued norm, an empty list, a non-fp32 grad, which megatron's assert refuses) goes to
the function it replaces, under the mode. A speed patch: nothing fails without it. CPU only.
"""

import inspect

import torch
import torch.distributed as dist
from packaging.specifiers import SpecifierSet

from ._base import Patch, require

# The functions these replace (as `cuda_tensors_to_cpu` left them: under its mode).
_FALLBACK = {}


def _plain(tensors) -> bool:
    return all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in tensors)


def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
    """`clip_grads.get_grad_norm_fp32` for the L2 norm of plain fp32 grads (else megatron's)."""
    grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else list(grads_for_norm)
    from megatron.core.optimizer import clip_grads

    # With a tensor-scale kernel (apex/TE, megatron-core >= 0.19) megatron returns a tensor norm.
    tensor_norm = getattr(clip_grads, "multi_tensor_scale_tensor_impl", None) is not None
    if float(norm_type) != 2.0 or not grads or not _plain(grads) or tensor_norm:
        return _FALLBACK["get_grad_norm_fp32"](grads_for_norm, norm_type, grad_stats_parallel_group)

    flag = torch.zeros(1, dtype=torch.int, device=grads[0].device)
    grad_norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, flag, [grads], False)
    total_norm = grad_norm**2.0  # summed over ranks as a square, as megatron does
    dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=grad_stats_parallel_group)
    return total_norm.item() ** 0.5


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """`clip_grads.clip_grad_by_total_norm_fp32` for `.grad` and a float norm (else megatron's)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if use_decoupled_grad or isinstance(total_norm, torch.Tensor) or not grads or not _plain(grads):
        return _FALLBACK["clip_grad_by_total_norm_fp32"](parameters, max_norm, total_norm, use_decoupled_grad)
    from megatron.core.optimizer import clip_grads

    grads = [g.detach() for g in grads]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        flag = torch.zeros(1, dtype=torch.int, device=grads[0].device)
        clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl, flag, [grads, grads], clip_coeff)
    return None


_REPLACEMENTS = {f.__name__: f for f in (get_grad_norm_fp32, clip_grad_by_total_norm_fp32)}


def _check() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    for name, ours in _REPLACEMENTS.items():
        upstream = getattr(clip_grads, name, None)
        require(upstream is not None, "native_clip_grads", f"clip_grads.{name} is gone")
        require(
            list(inspect.signature(upstream).parameters) == list(inspect.signature(ours).parameters),
            "native_clip_grads",
            f"clip_grads.{name} takes {list(inspect.signature(upstream).parameters)}",
        )
        require(hasattr(optimizer, name), "native_clip_grads", f"optimizer.{name} is gone")
    for name in ("multi_tensor_applier", "l2_norm_impl", "multi_tensor_scale_impl"):
        require(hasattr(clip_grads, name), "native_clip_grads", f"clip_grads.{name} is gone")


def _apply() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    for name, ours in _REPLACEMENTS.items():
        current = getattr(clip_grads, name)
        if current is ours:
            continue
        _FALLBACK[name] = current
        for module in (clip_grads, optimizer):  # optimizer.py holds its own references
            if getattr(module, name) is current:
                setattr(module, name, ours)


PATCH = Patch(
    name="native_clip_grads",
    fixes="(speed) megatron's grad norm and clipping run every torch call under the CUDA-to-CPU mode",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="cpu",
    check=_check,
    apply=_apply,
    speed_only=True,
)
