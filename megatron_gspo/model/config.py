"""Architecture of a Qwen3-MoE-shaped policy, and how it maps to HF and Megatron configs.

One dataclass describes the network; `hf.config.to_hf_config` / `from_hf_config` translate it to
and from HF `Qwen3MoeConfig` fields (config.json), and `model/builder.py` turns it into a
Megatron `TransformerConfig`. Presets: `tiny` (CPU tests and the demo), `qwen3_30b_a3b`
and `qwen3_235b_a22b` (sizes of the released checkpoints; never instantiated on CPU).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class MoEModelConfig:
    """Qwen3-MoE architecture (every layer is an MoE layer)."""

    vocab_size: int = 32
    """Vocabulary size (rows of the embedding and output layer)."""
    hidden_size: int = 64
    """Model width H."""
    num_layers: int = 2
    """Transformer layers; each has attention and an MoE MLP."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA groups); HF `num_key_value_heads`."""
    head_dim: int = 16
    """Per-head width; HF `head_dim`, Megatron `kv_channels`."""
    num_experts: int = 8
    """Routed experts per MoE layer."""
    moe_topk: int = 2
    """Experts per token; HF `num_experts_per_tok`."""
    moe_ffn_hidden_size: int = 32
    """Expert FFN width; HF `moe_intermediate_size`."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to 1 (Qwen3-MoE checkpoints: true)."""
    rope_theta: float = 1_000_000.0
    """RoPE base (any float)."""
    rope_type: str = "default"
    """RoPE variant: `default`, or `yarn` (YaRN context extension, megatron's YaRN rotary embedding)."""
    yarn_factor: float | None = None
    """YaRN scaling factor; None: max_position_embeddings / yarn_original_max_position_embeddings."""
    yarn_original_max_position_embeddings: int | None = None
    """Context length YaRN extends from; None: max_position_embeddings."""
    yarn_beta_fast: float | None = None
    """YaRN ramp boundary of extrapolation (None: 32)."""
    yarn_beta_slow: float | None = None
    """YaRN ramp boundary of interpolation (None: 1)."""
    yarn_mscale: float | None = None
    """YaRN attention-factor numerator scale; used only with yarn_mscale_all_dim (both non-zero)."""
    yarn_mscale_all_dim: float | None = None
    """YaRN attention-factor denominator scale; used only with yarn_mscale (both non-zero)."""
    yarn_truncate: bool | None = None
    """Round YaRN's correction range to whole dimensions (None: true)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (Qwen3: 1e-6; Megatron's default 1e-5 would be wrong)."""
    max_position_embeddings: int = 512
    """Longest sequence the model is built for."""
    tie_word_embeddings: bool = False
    """Share input embedding and output layer (Qwen3-MoE: false)."""
    aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss coefficient (0 disables it); HF `router_aux_loss_coef`."""
    init_std: float = 0.02
    """Std of the normal weight init; HF `initializer_range`."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_query_groups={self.num_query_groups} (grouped-query attention)"
            )
        if not 1 <= self.moe_topk <= self.num_experts:
            raise ValueError(f"moe_topk={self.moe_topk} must be in [1, num_experts={self.num_experts}]")
        if self.rope_type not in ("default", "yarn"):
            raise ValueError(f"rope_type={self.rope_type!r} must be 'default' or 'yarn'")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta!r} must be > 0")
        if self.rope_type == "yarn" and not self.yarn_factor_resolved > 0:
            raise ValueError(f"yarn_factor={self.yarn_factor!r} must be > 0")

    @property
    def yarn_original_max_positions(self) -> int:
        """YaRN's original context length, resolved as transformers resolves it."""
        return self.yarn_original_max_position_embeddings or self.max_position_embeddings

    @property
    def yarn_factor_resolved(self) -> float:
        """YaRN's scaling factor, resolved as transformers resolves it."""
        if self.yarn_factor is not None:
            return self.yarn_factor
        return self.max_position_embeddings / self.yarn_original_max_positions

    @property
    def num_parameters(self) -> int:
        """Total parameter count (all experts), as built by the Megatron builder."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_attention_heads + 2 * self.num_query_groups)
        attn += self.num_attention_heads * d * h + 2 * d + h  # o_proj, q/k norms, input norm
        moe = self.num_experts * 3 * h * self.moe_ffn_hidden_size + self.num_experts * h + h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + moe) + emb + h

    def replace(self, **changes: Any) -> MoEModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def tiny(vocab_size: int = 32, **changes: Any) -> MoEModelConfig:
    """A 2-layer, 8-expert top-2 MoE that runs a forward+backward in milliseconds on CPU."""
    return MoEModelConfig(vocab_size=vocab_size, **changes)


def qwen3_30b_a3b(**changes: Any) -> MoEModelConfig:
    """Qwen3-30B-A3B: 48 layers, 128 experts, top-8 (sizes of the released checkpoint)."""
    base = MoEModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_attention_heads=32,
        num_query_groups=4,
        head_dim=128,
        num_experts=128,
        moe_topk=8,
        moe_ffn_hidden_size=768,
        norm_topk_prob=True,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        aux_loss_coeff=0.001,
    )
    return base.replace(**changes)


def qwen3_235b_a22b(**changes: Any) -> MoEModelConfig:
    """Qwen3-235B-A22B: 94 layers, 128 experts, top-8 (sizes of the released checkpoint)."""
    base = MoEModelConfig(
        vocab_size=151936,
        hidden_size=4096,
        num_layers=94,
        num_attention_heads=64,
        num_query_groups=4,
        head_dim=128,
        num_experts=128,
        moe_topk=8,
        moe_ffn_hidden_size=1536,
        norm_topk_prob=True,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        aux_loss_coeff=0.001,
    )
    return base.replace(**changes)


PRESETS = {"tiny": tiny, "qwen3_30b_a3b": qwen3_30b_a3b, "qwen3_235b_a22b": qwen3_235b_a22b}


def preset(name: str, **changes: Any) -> MoEModelConfig:
    """A named preset with optional field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name](**changes)
