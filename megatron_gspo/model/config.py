"""Architecture of a Qwen3-MoE-shaped policy, and how it maps to HF and Megatron configs.

One dataclass describes the network; `to_hf_config` / `from_hf_config` translate it to
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
    """RoPE base."""
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

    @property
    def num_parameters(self) -> int:
        """Total parameter count (all experts), as built by the Megatron builder."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_attention_heads + 2 * self.num_query_groups)
        attn += self.num_attention_heads * d * h + 2 * d + h  # o_proj, q/k norms, input norm
        moe = self.num_experts * 3 * h * self.moe_ffn_hidden_size + self.num_experts * h + h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + moe) + emb + h

    def to_hf_config(self) -> dict[str, Any]:
        """Fields of an HF `Qwen3MoeConfig` (config.json) describing this architecture."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.moe_topk,
            "moe_intermediate_size": self.moe_ffn_hidden_size,
            # Dense FFN width is unused (every layer is sparse) but required by the class.
            "intermediate_size": 4 * self.moe_ffn_hidden_size,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": self.norm_topk_prob,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "router_aux_loss_coef": self.aux_loss_coeff,
            "output_router_logits": False,
            "initializer_range": self.init_std,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> MoEModelConfig:
        """Read an HF Qwen3-MoE config.json dict; refuses layouts this builder cannot express."""
        if hf.get("model_type") not in (None, "qwen3_moe"):
            raise ValueError(f"expected a qwen3_moe config, got model_type={hf.get('model_type')!r}")
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise ValueError("only all-MoE layouts are supported (decoder_sparse_step=1, mlp_only_layers=[])")
        rope = hf.get("rope_parameters") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            num_experts=hf["num_experts"],
            moe_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            rope_theta=float(theta),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            aux_loss_coeff=hf.get("router_aux_loss_coef", 0.0),
            init_std=hf.get("initializer_range", 0.02),
        )

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
