"""Without TransformerEngine, megatron-core 0.16 raises NameError in every MoE router forward.

`RouterGatingLinearFunction` tests `te_general_gemm is not None`, but `moe_utils` only
defines that name inside its TransformerEngine import block. Defining it as None selects
the torch matmul path the code already has. Fixed upstream in 0.17.0 (the name is defined
as None without TransformerEngine; checked on 0.17.0, 0.17.1, 0.18.2, 0.19.0 and 0.19.2).
"""

import inspect

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ._base import Patch, require


def _check() -> None:
    from megatron.core.transformer.moe import moe_utils

    source = inspect.getsource(moe_utils.RouterGatingLinearFunction)
    require("te_general_gemm is not None" in source, "te_general_gemm", "router gating no longer tests it")


def _apply() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


PATCH = Patch(
    name="te_general_gemm",
    fixes="NameError: te_general_gemm in RouterGatingLinearFunction when TransformerEngine is absent",
    verified=SpecifierSet(">=0.16.1,<0.17"),
    fixed_in=Version("0.17.0"),
    needed_when="no_te",
    check=_check,
    apply=_apply,
)
