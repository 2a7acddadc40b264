"""Megatron's `SequentialMLP` runs its local experts as two grouped matmuls instead of a Python loop.

Without TransformerEngine the MoE experts are megatron's `SequentialMLP`: per local expert one
megatron `MLP` (a column- and a row-parallel linear layer, each a custom autograd function) on
that expert's slice of the permuted tokens. On a small model the per-expert Python costs more
than the matmuls: the demo's 2 layers x 8 experts make 32 linear calls per forward and as
many backward functions. The replacement stacks the experts' fc1 and fc2 weights and runs
`torch._grouped_mm` over the expert slices, with `MLP.forward`'s activation, probability
scaling and casts: outputs and every gradient are bit-identical to the loop on CPU, fp32 and
bf16 (tests/patches/). Each expert keeps its own parameters, so checkpoints, weight sync and
gradient buffers do not change. Expert linears never communicate (megatron leaves the expert
exchange to the token dispatcher), so the grouped matmuls are the same local math at any TP/EP.

Only the plain path is replaced: biases, fp8/fp4, fused or TE activations, gradient
accumulation fusion, delayed weight gradients, TE linears or widths `_grouped_mm` cannot
take (rows must be multiples of 16 bytes) run megatron's loop. A speed patch: nothing fails
without it. CPU only: with a GPU the TE spec's `TEGroupedMLP` is the grouped path.
"""

import inspect

import torch
from packaging.specifiers import SpecifierSet

from ._base import Patch, require

_ORIGINAL = {}


def groupable(experts) -> bool:
    """Whether `experts` (a SequentialMLP) is the plain loop `grouped_forward` reproduces exactly."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP

    cfg = experts.config
    unsupported = (
        experts.num_local_experts < 2,
        cfg.fp8,
        getattr(cfg, "fp4", None),
        cfg.moe_apply_probs_on_input,
        cfg.add_bias_linear,
        cfg.bias_activation_fusion,
        getattr(cfg, "use_te_activation_func", False),
        cfg.gradient_accumulation_fusion,
        getattr(cfg, "delay_wgrad_compute", False),
    )
    if any(unsupported):
        return False
    return all(
        type(e) is MLP
        and type(e.linear_fc1) is ColumnParallelLinear
        and type(e.linear_fc2) is RowParallelLinear
        for e in experts.local_experts
    )


def grouped_forward(experts, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
    """`SequentialMLP.forward` of a `groupable` module: two `_grouped_mm` over the expert slices."""
    cfg = experts.config
    fc1 = torch.stack([e.linear_fc1.weight for e in experts.local_experts])  # [E, 2F or F, H]
    fc2 = torch.stack([e.linear_fc2.weight for e in experts.local_experts])  # [E, H, F]
    offsets = tokens_per_expert.to(device=hidden.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    intermediate = torch._grouped_mm(hidden, fc1.transpose(1, 2), offs=offsets)
    if cfg.gated_linear_unit:  # MLP.forward's glu, op for op
        x_glu, x_linear = torch.chunk(intermediate, 2, dim=-1)
        if (val := cfg.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        intermediate = cfg.activation_func(x_glu) * (x_linear + cfg.glu_linear_offset)
    else:
        intermediate = experts.local_experts[0].activation_func(intermediate)
    intermediate = (intermediate * probs.unsqueeze(-1)).to(intermediate.dtype)
    output = torch._grouped_mm(intermediate, fc2.transpose(1, 2), offs=offsets)
    if output.requires_grad:  # _grouped_mm's backward refuses an expanded (stride-0) gradient
        output.register_hook(torch.Tensor.contiguous)
    return output, None


def _aligned(experts, hidden: torch.Tensor) -> bool:
    """`_grouped_mm` takes operands whose rows are multiples of 16 bytes, all of one dtype."""
    fc2 = experts.local_experts[0].linear_fc2.weight
    hidden_size, ffn = fc2.shape
    step = 16 // hidden.element_size()
    widths_fit = hidden_size % step == 0 and ffn % step == 0
    return widths_fit and hidden.dtype == fc2.dtype and hidden.is_contiguous()


def patched_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
    """`SequentialMLP.forward`: the grouped matmuls where they match the loop, else the loop."""
    if groupable(self) and _aligned(self, permuted_local_hidden_states):
        return grouped_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)
    return _ORIGINAL["forward"](self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)


def _check() -> None:
    from megatron.core.transformer.moe.experts import SequentialMLP

    params = list(inspect.signature(SequentialMLP.forward).parameters)
    require(
        params == ["self", "permuted_local_hidden_states", "tokens_per_expert", "permuted_probs"],
        "grouped_local_experts",
        f"SequentialMLP.forward takes {params}",
    )
    require(hasattr(torch, "_grouped_mm"), "grouped_local_experts", "this torch has no torch._grouped_mm")


def _apply() -> None:
    from megatron.core.transformer.moe.experts import SequentialMLP

    _ORIGINAL["forward"] = SequentialMLP.forward
    SequentialMLP.forward = patched_forward


PATCH = Patch(
    name="grouped_local_experts",
    fixes="(speed) megatron's SequentialMLP loops over local experts in Python",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="cpu",
    check=_check,
    apply=_apply,
    speed_only=True,
)
