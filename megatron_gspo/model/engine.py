"""The engine settings (dtype, TE spec, fused kernels) and which kernels this machine can run.

`EngineConfig` is the part of a run that differs between a CPU box and an H100 node.

Each fused flag of `TransformerConfig` needs something specific (megatron-core 0.16.1):

- `gradient_accumulation_fusion`: CUDA + apex's `fused_weight_gradient_mlp_cuda`. Megatron's
  own `ColumnParallelLinear` (the output layer) raises without it, even under the TE spec.
- `moe_grouped_gemm`: CUDA + the TE spec (`TEGroupedMLP`; the local spec's `GroupedMLP` would
  need the `grouped_gemm` package).
- `moe_permute_fusion`, `apply_rope_fusion`: CUDA + TE (TE's fused permute / RoPE;
  `TransformerConfig` refuses them otherwise).
- `moe_router_fusion`: CUDA + TE, and only when asked for (it bypasses routing replay).
- `bias_activation_fusion`, `bias_dropout_fusion`: CUDA only: megatron's `torch.compile`d
  SwiGLU (`fusions/fused_bias_swiglu.py`) and jit-fused bias-dropout-add need no TE or apex.
- `masked_softmax_fusion`: never. Only the local spec reads it, and its causal kernel ignores
  the attention mask, i.e. the block-diagonal mask of packed samples; TE attention ignores it.
- `persist_layer_norm`: never (apex's persistent LayerNorm; the model uses RMSNorm).
- `cross_entropy_loss_fusion`: never (only `GPTModel`'s LM loss reads it; log-probs come from
  `model/logprobs.py`).

The CPU path (no CUDA) uses none of them, so it is the same whatever is installed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelAvailability:
    """What this process can run.

    Attributes:
        cuda: a CUDA device is available.
        te: TransformerEngine imports.
        apex_grad_accum: apex's `fused_weight_gradient_mlp_cuda` extension imports.
    """

    cuda: bool
    te: bool
    apex_grad_accum: bool

    @classmethod
    def detect(cls) -> KernelAvailability:
        """The facts of the current process."""
        from megatron_gspo.patches import transformer_engine_available

        return cls(
            cuda=torch.cuda.is_available(),
            te=transformer_engine_available(),
            apex_grad_accum=_imports("fused_weight_gradient_mlp_cuda"),
        )


def _imports(module: str) -> bool:
    """Whether `module` imports (a compiled extension can exist yet fail to load)."""
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - ImportError, OSError of a broken .so: either way unusable
        return False
    return True


def resolve_use_te(engine: EngineConfig, available: KernelAvailability) -> bool:
    """The TE layer spec: as asked, else when CUDA and TE are both there.

    Raises:
        ValueError: `engine.use_te=true` without CUDA or without TransformerEngine.
    """
    if engine.use_te is None:
        return available.cuda and available.te
    if engine.use_te and not (available.cuda and available.te):
        missing = "CUDA" if not available.cuda else "transformer_engine (it does not import)"
        raise ValueError(f"engine.use_te=true needs {missing}")
    return engine.use_te


def wants_fused_kernels(engine: EngineConfig, available: KernelAvailability) -> bool:
    """Whether `engine` asks for the fused kernels on this machine (asked for, or the TE default)."""
    if engine.fused_kernels is not None:
        return engine.fused_kernels
    return engine.use_te if engine.use_te is not None else available.cuda and available.te


def fused_flags(engine: EngineConfig, available: KernelAvailability) -> dict[str, bool]:
    """The fused-kernel flags of `TransformerConfig` for `engine` on a machine with `available`.

    Args:
        engine: the run's engine settings (`use_te`, `fused_kernels`, `router_fusion`).
        available: CUDA / TransformerEngine / apex extension facts (`KernelAvailability.detect()`).

    Returns:
        {TransformerConfig field: bool} for every fused flag in the module table.

    Raises:
        ValueError: a setting asked for explicitly that this machine cannot run.
    """
    use_te = resolve_use_te(engine, available)
    fused = wants_fused_kernels(engine, available)
    if fused and not use_te:
        raise ValueError("engine.fused_kernels needs the TransformerEngine spec (CUDA + transformer_engine)")
    if engine.router_fusion and not use_te:
        raise ValueError("engine.router_fusion needs the TransformerEngine spec (CUDA + transformer_engine)")
    te_fused = fused and use_te  # use_te implies CUDA
    gpu_fused = fused and available.cuda
    return {
        "gradient_accumulation_fusion": gpu_fused and available.apex_grad_accum,
        "moe_grouped_gemm": te_fused,
        "moe_permute_fusion": te_fused,
        "apply_rope_fusion": te_fused,
        "moe_router_fusion": engine.router_fusion,
        "bias_activation_fusion": gpu_fused,
        "bias_dropout_fusion": gpu_fused,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "cross_entropy_loss_fusion": False,
    }


@dataclass
class EngineConfig:
    """Numerics and kernels: the part that differs between a CPU box and an H100 node."""

    dtype: str = "fp32"
    """Parameter and compute dtype: fp32, or bf16 (megatron's mixed precision, on CPU and GPU alike)."""
    use_te: bool | None = None
    """TransformerEngine layer spec; default: when TE imports and CUDA is available."""
    fused_kernels: bool | None = None
    """Fused kernels (grouped GEMM, permute, RoPE, SwiGLU...; see `fused_flags`); default: as use_te."""
    recompute_activations: bool = False
    """Full activation recomputation of every layer (saves memory on large models)."""
    router_fusion: bool = False
    """Fused router top-k (GPU). It bypasses megatron's routing replay, so replay refuses it."""

    def __post_init__(self) -> None:
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"engine.dtype must be fp32 or bf16, got {self.dtype!r}")
        if self.fused_kernels and self.use_te is False:
            raise ValueError("engine.fused_kernels needs the TransformerEngine spec (use_te)")
        if self.router_fusion and self.use_te is False:
            raise ValueError("engine.router_fusion needs TransformerEngine (use_te)")

    def check_hardware(self, available: KernelAvailability | None = None) -> None:
        """Refuse settings this machine cannot run (called when a model is built).

        Kept out of `__post_init__` so GPU configs can be loaded and validated on a CPU box.

        Args:
            available: the machine's kernels; default `KernelAvailability.detect()`.
        """
        available = available or KernelAvailability.detect()
        fused_flags(self, available)  # raises for use_te / fused kernels / router fusion it cannot run

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of `dtype`."""
        return torch.bfloat16 if self.dtype == "bf16" else torch.float32
