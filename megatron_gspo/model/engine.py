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


RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe_act", "moe")
"""Selective recompute's modules that exist in a Qwen3-MoE layer (megatron-core 0.16 and 0.19 both
accept them; its mlp, shared_experts, mla_up_proj and gdn_norm_out have nothing to rebuild here)."""


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
    """Full recompute of every layer: the older spelling of recompute_granularity=full."""
    recompute_granularity: str | None = None
    """Megatron's activation recompute: full (every layer rebuilt from its input in the backward,
    MoE all-to-all included), selective (only `recompute_modules`), or null (off)."""
    recompute_modules: list[str] | None = None
    """Selective recompute's parts of every layer (megatron's names; null: ["core_attn"], its
    default): core_attn (local attention's score matrix; TE's fused attention keeps none),
    layernorm (the norms' outputs), moe_act (the experts' SwiGLU output; grouped GEMM only),
    moe (the whole MoE block: reruns its all-to-all, as full recompute does)."""
    router_fusion: bool = False
    """Fused router top-k (GPU). It bypasses megatron's routing replay, so replay refuses it."""

    def __post_init__(self) -> None:
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"engine.dtype must be fp32 or bf16, got {self.dtype!r}")
        if self.fused_kernels and self.use_te is False:
            raise ValueError("engine.fused_kernels needs the TransformerEngine spec (use_te)")
        if self.router_fusion and self.use_te is False:
            raise ValueError("engine.router_fusion needs TransformerEngine (use_te)")
        self._check_recompute()

    def _check_recompute(self) -> None:
        granularity, modules = self.recompute_granularity, self.recompute_modules
        if granularity not in (None, "full", "selective"):
            raise ValueError(
                f"engine.recompute_granularity must be full, selective or null, got {granularity!r}"
            )
        if self.recompute_activations and granularity == "selective":
            raise ValueError(
                "engine.recompute_activations=true is full recompute; with recompute_granularity="
                "selective set recompute_activations=false"
            )
        if modules is not None and granularity != "selective":
            raise ValueError(
                f"engine.recompute_modules={modules} apply to recompute_granularity=selective only "
                f"(it is {granularity})"
            )
        if modules is not None and not modules:
            raise ValueError(
                "engine.recompute_modules=[] recomputes nothing; list some or set recompute_granularity=null"
            )
        unknown = sorted(set(modules or ()) - set(RECOMPUTE_MODULES))
        if unknown:
            raise ValueError(
                f"engine.recompute_modules: {unknown} is not a part of a Qwen3-MoE layer megatron "
                f"recomputes; choose from {list(RECOMPUTE_MODULES)}"
            )

    @property
    def recompute(self) -> str | None:
        """The recompute granularity megatron runs: full, selective or None."""
        return "full" if self.recompute_activations else self.recompute_granularity

    @property
    def selective_modules(self) -> list[str]:
        """The modules selective recompute rebuilds (megatron's default when unset); [] otherwise."""
        if self.recompute != "selective":
            return []
        return list(self.recompute_modules or ["core_attn"])

    def check_hardware(self, available: KernelAvailability | None = None) -> None:
        """Refuse settings this machine cannot run (called when a model is built).

        Kept out of `__post_init__` so GPU configs can be loaded and validated on a CPU box.

        Args:
            available: the machine's kernels; default `KernelAvailability.detect()`.
        """
        available = available or KernelAvailability.detect()
        flags = fused_flags(self, available)  # raises for use_te / fused kernels / router fusion unavailable
        # megatron's output-discarding checkpoint (layernorm, moe_act) reads TE's FP8 state even
        # without FP8 (`CheckpointWithoutOutput(fp8=False).fp8` is True, 0.16.1 and 0.19.2).
        needs_te = sorted({"layernorm", "moe_act"} & set(self.selective_modules))
        if needs_te and not available.te:
            raise ValueError(
                f"engine.recompute_modules has {needs_te}: megatron recomputes them through "
                "TransformerEngine, which does not import here; drop them (core_attn and moe need no TE)"
            )
        if "moe_act" in self.selective_modules and not flags["moe_grouped_gemm"]:
            raise ValueError(
                "engine.recompute_modules has moe_act, which megatron recomputes in grouped-GEMM experts "
                "only (engine.fused_kernels with the TransformerEngine spec: CUDA + transformer_engine); "
                "drop moe_act"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of `dtype`."""
        return torch.bfloat16 if self.dtype == "bf16" else torch.float32
