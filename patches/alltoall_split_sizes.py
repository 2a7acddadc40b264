"""Alltoall dispatcher split sizes must be host lists for gloo.

`maybe_move_tensor_to_cpu(..., as_numpy=True)` converts only CUDA tensors, so on CPU the
dispatcher's input/output split sizes stay torch tensors and gloo's
`all_to_all_single(output_split_sizes=<Tensor>)` raises TypeError. Return numpy arrays,
the same type the CUDA path produces.
"""

import inspect

import torch
from packaging.specifiers import SpecifierSet

from ._base import Patch, require


def _check() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    params = list(inspect.signature(moe_utils.maybe_move_tensor_to_cpu).parameters)
    require(params == ["tensor", "as_numpy", "record_stream"], "alltoall_split_sizes", f"signature {params}")
    require(
        token_dispatcher.maybe_move_tensor_to_cpu is moe_utils.maybe_move_tensor_to_cpu,
        "alltoall_split_sizes",
        "token_dispatcher no longer imports maybe_move_tensor_to_cpu from moe_utils",
    )


def _apply() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


PATCH = Patch(
    name="alltoall_split_sizes",
    fixes="EP>1 alltoall dispatcher passes tensor split sizes that gloo rejects",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="cpu",
    check=_check,
    apply=_apply,
)
