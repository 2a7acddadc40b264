"""HF Qwen3-MoE `config.json` <-> `MoEModelConfig`: the one mapping, and what it refuses.

Reads the names transformers 5.x writes (`num_local_experts`, `rope_parameters`) and the
4.x ones (`num_experts`, a top-level `rope_theta`, `rope_scaling`). Every field of
transformers' `Qwen3MoeConfig` is implemented, ignored because it changes neither the
weights nor the forward pass, or refused with an `UnsupportedArchitectureError` that names
it: a model that would be trained as something else is never accepted.

Implemented (config.json -> MoEModelConfig field):
    vocab_size; hidden_size; num_hidden_layers -> num_layers; num_attention_heads;
    num_key_value_heads -> num_query_groups (default: num_attention_heads); head_dim
    (default hidden_size / num_attention_heads); num_local_experts or num_experts ->
    num_experts; num_experts_per_tok -> moe_topk (top-1 included); moe_intermediate_size ->
    moe_ffn_hidden_size; norm_topk_prob; rms_norm_eps; max_position_embeddings;
    tie_word_embeddings; router_aux_loss_coef -> aux_loss_coeff; initializer_range ->
    init_std; rope_theta (any float; in `rope_parameters` or top level); rope_type
    `default` or `yarn` with factor, original_max_position_embeddings, beta_fast,
    beta_slow, mscale, mscale_all_dim, truncate -> yarn_* (megatron's YaRN rotary embedding).
Refused unless they have the one value the model implements:
    model_type `qwen3_moe`; architectures [Qwen3MoeForCausalLM]; hidden_act `silu` (the
    SwiGLU experts); attention_bias false; use_sliding_window false (sliding-window
    attention); decoder_sparse_step 1 and mlp_only_layers [] (every layer MoE, no dense
    layers mixed in); attention_dropout 0; mlp_bias false; rope_type other than
    default/yarn (linear, dynamic, llama3, longrope, ...); partial_rotary_factor 1; YaRN
    attention_factor (megatron derives it from factor/mscale); no quantization_config; no
    pruned_heads.
Ignored (no effect on the weights or the forward pass):
    intermediate_size (width of the dense MLP of mlp_only_layers, of which there are none);
    sliding_window and max_window_layers (read only with use_sliding_window); use_cache;
    output_router_logits; bos/eos/pad_token_id (the tokenizer's business); torch_dtype /
    dtype (engine.dtype decides); transformers_version, _name_or_path, id2label and the
    other generic PretrainedConfig fields.

Export writes `num_experts` (which transformers 4.x and 5.x both read; 5.x maps it to
`num_local_experts`) and the RoPE settings both as 5.x `rope_parameters` and as 4.x
`rope_theta` / `rope_scaling`, so the exported config describes the model trained.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_gspo.errors import ConfigError
from megatron_gspo.model.config import MoEModelConfig

# What transformers' Qwen3MoeConfig assumes when config.json leaves a field out.
_HF_DEFAULT_THETA = 10_000.0
_YARN_KEYS = {
    "factor": "yarn_factor",
    "original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "beta_fast": "yarn_beta_fast",
    "beta_slow": "yarn_beta_slow",
    "mscale": "yarn_mscale",
    "mscale_all_dim": "yarn_mscale_all_dim",
    "truncate": "yarn_truncate",
}


class HFConfigError(ConfigError):
    """A checkpoint's config.json cannot be read as a Qwen3-MoE architecture (names the key)."""


class UnsupportedArchitectureError(HFConfigError):
    """config.json describes an architecture this trainer does not implement (names the feature)."""


def _refuse(where: str, feature: str, detail: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"{where}: unsupported architecture: {feature} ({detail}); loading it would train a different model"
    )


def _has_type(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):  # JSON true is not a number here
        return False
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind) and (kind is not int or value >= 1)  # every integer here is a size


def _value(hf: Mapping[str, Any], where: str, kind: type, *keys: str, default: Any = ...) -> Any:
    """The first of `keys` present (not null) in `hf`, checked to be a `kind`; `default` if none is."""
    for key in keys:
        value = hf.get(key)
        if value is None:
            continue
        if not _has_type(value, kind):
            expected = {float: "a finite number", int: "an integer >= 1", bool: "true or false"}[kind]
            raise HFConfigError(f"{where}: {key}={value!r} must be {expected}")
        return float(value) if kind is float else value
    if default is ...:
        raise HFConfigError(f"{where}: missing key {' or '.join(repr(k) for k in keys)}")
    return default


def _check_supported(hf: Mapping[str, Any], where: str) -> None:
    """Raise `UnsupportedArchitectureError` for every field whose value this model cannot reproduce."""
    model_type = hf.get("model_type")
    if model_type not in (None, "qwen3_moe"):
        raise _refuse(where, "not a Qwen3-MoE model", f"model_type={model_type!r}, expected 'qwen3_moe'")
    architectures = hf.get("architectures")
    if architectures not in (None, [], ["Qwen3MoeForCausalLM"]):
        raise _refuse(
            where, "not a causal LM", f"architectures={architectures!r}, expected ['Qwen3MoeForCausalLM']"
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(where, "non-SiLU activation", f"hidden_act={act!r}; only 'silu' (SwiGLU experts)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise _refuse(where, "attention bias" if key == "attention_bias" else "MLP bias", f"{key}=true")
    if hf.get("use_sliding_window"):
        raise _refuse(
            where,
            "sliding-window attention",
            f"use_sliding_window=true, sliding_window={hf.get('sliding_window')!r}",
        )
    step = hf.get("decoder_sparse_step", 1)
    if step != 1:
        raise _refuse(
            where, "dense layers mixed in", f"decoder_sparse_step={step!r}; every layer must be MoE (1)"
        )
    dense = hf.get("mlp_only_layers") or []
    if dense:
        raise _refuse(
            where, "dense layers mixed in", f"mlp_only_layers={dense!r}; every layer must be MoE ([])"
        )
    dropout = hf.get("attention_dropout", 0.0)
    if dropout:
        raise _refuse(
            where, "attention dropout", f"attention_dropout={dropout!r}; training runs without dropout (0)"
        )
    for key in ("quantization_config", "pruned_heads"):
        if hf.get(key):
            raise _refuse(where, "quantized weights" if key == "quantization_config" else "pruned heads", key)


def _rope(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """MoEModelConfig's RoPE fields from `rope_parameters` (5.x) or `rope_theta` + `rope_scaling` (4.x)."""
    key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    raw = hf.get(key) or {}
    if not isinstance(raw, Mapping):
        raise HFConfigError(f"{where}: {key}={raw!r} must be an object")
    if any(isinstance(v, Mapping) for v in raw.values()):
        raise _refuse(where, "per-layer-type RoPE", f"{key}={raw!r}")
    params = dict(raw)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = _value(params, where, float, "rope_theta", default=None)
    theta = _value(hf, where, float, "rope_theta", default=_HF_DEFAULT_THETA) if theta is None else theta
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _refuse(where, "partial rotary embedding", f"partial_rotary_factor={partial!r}")
    out: dict[str, Any] = {"rope_theta": theta, "rope_type": rope_type}
    if rope_type == "default":
        return out
    if rope_type != "yarn":
        raise _refuse(
            where, f"RoPE scaling {rope_type!r}", f"rope_type={rope_type!r}; implemented: default, yarn"
        )
    if params.get("attention_factor") is not None:
        raise _refuse(
            where, "YaRN attention_factor", "megatron derives it from factor, mscale and mscale_all_dim"
        )
    floats = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    for key, field in _YARN_KEYS.items():
        kind = float if key in floats else bool if key == "truncate" else int
        value = _value(params, f"{where} rope_parameters", kind, key, default=None)
        if value is not None:
            out[field] = value
    # transformers gives a top-level original_max_position_embeddings priority (Phi-3 style).
    original = _value(hf, where, int, "original_max_position_embeddings", default=None)
    if original is not None:
        out["yarn_original_max_position_embeddings"] = original
    return out


def from_hf_config(hf: Mapping[str, Any], where: str = "config.json") -> MoEModelConfig:
    """The architecture a Qwen3-MoE config.json dict describes (transformers 4.x or 5.x names).

    Args:
        hf: the parsed config.json.
        where: what to call it in errors (usually its path).

    Raises:
        UnsupportedArchitectureError: a field would change the model into one this trainer
            does not implement (the feature and the field are named).
        HFConfigError: a required key is missing or a value has the wrong type or is out of range.
    """
    if not isinstance(hf, Mapping):
        raise HFConfigError(f"{where}: expected a JSON object, got {type(hf).__name__}")
    _check_supported(hf, where)
    both = hf.get("num_local_experts"), hf.get("num_experts")
    if None not in both and both[0] != both[1]:
        raise HFConfigError(f"{where}: num_local_experts={both[0]!r} and num_experts={both[1]!r} disagree")
    heads = _value(hf, where, int, "num_attention_heads")
    hidden = _value(hf, where, int, "hidden_size")
    fields = {
        "vocab_size": _value(hf, where, int, "vocab_size"),
        "hidden_size": hidden,
        "num_layers": _value(hf, where, int, "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_query_groups": _value(hf, where, int, "num_key_value_heads", default=heads),
        "head_dim": _value(hf, where, int, "head_dim", default=hidden // heads if heads > 0 else 0),
        "num_experts": _value(hf, where, int, "num_local_experts", "num_experts"),
        "moe_topk": _value(hf, where, int, "num_experts_per_tok"),
        "moe_ffn_hidden_size": _value(hf, where, int, "moe_intermediate_size"),
        "norm_topk_prob": _value(hf, where, bool, "norm_topk_prob", default=False),
        "rms_norm_eps": _value(hf, where, float, "rms_norm_eps", default=1e-6),
        "max_position_embeddings": _value(hf, where, int, "max_position_embeddings", default=32768),
        "tie_word_embeddings": _value(hf, where, bool, "tie_word_embeddings", default=False),
        "aux_loss_coeff": _value(hf, where, float, "router_aux_loss_coef", default=0.001),
        "init_std": _value(hf, where, float, "initializer_range", default=0.02),
        **_rope(hf, where),
    }
    try:
        return MoEModelConfig(**fields)
    except ValueError as err:
        raise HFConfigError(f"{where}: {err}") from None


def to_hf_config(cfg: MoEModelConfig) -> dict[str, Any]:
    """The config.json of `cfg`, readable by transformers 4.x and 5.x alike."""
    rope: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "yarn":
        rope |= {
            key: getattr(cfg, field) for key, field in _YARN_KEYS.items() if getattr(cfg, field) is not None
        }
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_topk,
        "moe_intermediate_size": cfg.moe_ffn_hidden_size,
        # Dense FFN width is unused (every layer is sparse) but required by the class.
        "intermediate_size": 4 * cfg.moe_ffn_hidden_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": cfg.norm_topk_prob,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None
        if cfg.rope_type == "default"
        else {k: v for k, v in rope.items() if k != "rope_theta"},
        "rope_parameters": rope,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "router_aux_loss_coef": cfg.aux_loss_coeff,
        "output_router_logits": False,
        "initializer_range": cfg.init_std,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "use_sliding_window": False,
    }


def read_hf_config(hf_dir: str | os.PathLike) -> MoEModelConfig:
    """The architecture in `hf_dir/config.json`.

    Raises:
        HFConfigError: no readable config.json, or one this mapping refuses (see the module doc).
    """
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise HFConfigError(f"{hf_dir} is not an HF checkpoint directory: no config.json")
    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFConfigError(f"{path}: not readable JSON: {err}") from None
    return from_hf_config(hf, str(path))
