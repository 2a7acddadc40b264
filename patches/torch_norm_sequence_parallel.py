"""Let the local (torch) RMSNorm run under sequence parallelism.

MoE with TP > 1 requires `sequence_parallel=True` in training, but the local layer spec's
`WrappedTorchNorm` asserts `not config.sequence_parallel`. The norm itself is
position-wise, so it is correct on a sequence shard; what SP needs is that its weight's
gradient is all-reduced over the TP group, which megatron does for parameters marked
`sequence_parallel=True`. Only needed without TransformerEngine (TE norms support SP).
"""

import copy
import inspect

from packaging.specifiers import SpecifierSet

from ._base import Patch, require


def _check() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    source = inspect.getsource(WrappedTorchNorm)
    require("not config.sequence_parallel" in source, "torch_norm_sequence_parallel", "SP assert is gone")
    require("__new__" in WrappedTorchNorm.__dict__, "torch_norm_sequence_parallel", "no __new__ to wrap")


def _apply() -> None:
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        if sequence_parallel:
            config = copy.copy(config)
            config.sequence_parallel = False
        norm = original_new(cls, config, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


PATCH = Patch(
    name="torch_norm_sequence_parallel",
    fixes="WrappedTorchNorm asserts not sequence_parallel (MoE + TP needs SP)",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="no_te",
    check=_check,
    apply=_apply,
)
