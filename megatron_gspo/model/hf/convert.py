"""HF Qwen3-MoE checkpoints <-> the Megatron policy, at any TP x EP x PP layout.

The conversion is a name table plus two reshapes (everything else is a plain copy):

* attention: HF `q_proj` [nh*d, H], `k_proj` / `v_proj` [ng*d, H] are fused into Megatron's
  `linear_qkv` [ng*(r+2)*d, H] *per query group* g: [the r = nh/ng query heads of g; k_g; v_g];
* experts: HF `gate_proj` and `up_proj` [I, H] become `linear_fc1` = cat(gate, up) [2I, H].

`hf_to_megatron` / `megatron_to_hf` convert whole *global* state dicts (TP=EP=1 names, see
`model/sharding.py`). `load_hf_checkpoint` imports a checkpoint directory into a sharded
model lazily: each rank opens the safetensors files and reads only its own pipeline stage's
layers (HF numbers layers globally, as `sharding` names them), its own experts and,
under tensor parallelism, only its slices (both reshapes commute with Megatron's TP split:
a TP shard of `linear_qkv` is a contiguous block of query groups, a shard of `linear_fc1`
is [gate_r; up_r]). Writing a model out as an HF checkpoint streams it through these
converters (`model/hf/stream.py`, `model/hf/export.py`).

    python -m megatron_gspo.model.hf.convert --hf DIR --check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_gspo.errors import ConfigError
from megatron_gspo.model.config import MoEModelConfig
from megatron_gspo.model.distributed import unwrap_model
from megatron_gspo.model.hf.checkpoint import SAFE_WEIGHTS_INDEX_NAME, non_finite
from megatron_gspo.model.sharding import local_shard_plan

_COPY, _QKV, _FC1 = "copy", "qkv", "fc1"
# Megatron's TP split (partition_dim, partition_stride) each reshape is written for.
_TP_SPLIT = {_QKV: (0, 1), _FC1: (0, 2)}
# MoEModelConfig fields that change the weights or the forward pass (init_std, aux loss and
# max_position_embeddings do not).
ARCHITECTURE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "num_experts",
    "moe_topk",
    "moe_ffn_hidden_size",
    "norm_topk_prob",
    "rope_theta",
    "rope_type",
    "yarn_factor",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_mscale",
    "yarn_mscale_all_dim",
    "yarn_truncate",
    "rms_norm_eps",
    "tie_word_embeddings",
)


class ConversionError(ValueError):
    """A checkpoint or state dict does not match the architecture (names the tensor or field)."""


@dataclass(frozen=True)
class TensorMapping:
    """One Megatron tensor and the HF tensors it is made of.

    Attributes:
        megatron: Global Megatron name (TP=EP=1).
        hf: On-disk HF names, in merge order.
        hf_shapes: Expected shape of each HF tensor.
        kind: `copy` (one HF tensor as is), `qkv` (q, k, v fused per query group) or
            `fc1` (cat(gate, up)).
        vocab_rows: rows are the vocabulary; Megatron's tensor may have more (its TP padding,
            zero on import, dropped on export).
    """

    megatron: str
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    kind: str = _COPY
    vocab_rows: bool = False


def name_table(cfg: MoEModelConfig) -> list[TensorMapping]:
    """Every tensor of the architecture: Megatron name <- HF names, shapes and reshape kind."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.moe_ffn_hidden_size
    nh, ng = cfg.num_attention_heads, cfg.num_query_groups

    def copy(megatron: str, hf: str, shape: tuple[int, ...], vocab_rows: bool = False) -> TensorMapping:
        return TensorMapping(megatron, (hf,), (shape,), vocab_rows=vocab_rows)

    table = [
        copy("embedding.word_embeddings.weight", "model.embed_tokens.weight", (cfg.vocab_size, h), True),
        copy("decoder.final_layernorm.weight", "model.norm.weight", (h,)),
    ]
    if not cfg.tie_word_embeddings:  # tied: Megatron's output layer reuses the embedding
        table.append(copy("output_layer.weight", "lm_head.weight", (cfg.vocab_size, h), True))
    for i in range(cfg.num_layers):
        m, f = f"decoder.layers.{i}.", f"model.layers.{i}."
        table += [
            copy(m + "input_layernorm.weight", f + "input_layernorm.weight", (h,)),
            TensorMapping(
                m + "self_attention.linear_qkv.weight",
                tuple(f"{f}self_attn.{p}_proj.weight" for p in "qkv"),
                ((nh * d, h), (ng * d, h), (ng * d, h)),
                _QKV,
            ),
            copy(m + "self_attention.q_layernorm.weight", f + "self_attn.q_norm.weight", (d,)),
            copy(m + "self_attention.k_layernorm.weight", f + "self_attn.k_norm.weight", (d,)),
            copy(m + "self_attention.linear_proj.weight", f + "self_attn.o_proj.weight", (h, nh * d)),
            copy(m + "pre_mlp_layernorm.weight", f + "post_attention_layernorm.weight", (h,)),
            copy(m + "mlp.router.weight", f + "mlp.gate.weight", (cfg.num_experts, h)),
        ]
        for e in range(cfg.num_experts):
            me, fe = f"{m}mlp.experts.local_experts.{e}.", f"{f}mlp.experts.{e}."
            table += [
                TensorMapping(
                    me + "linear_fc1.weight",
                    (fe + "gate_proj.weight", fe + "up_proj.weight"),
                    ((inter, h), (inter, h)),
                    _FC1,
                ),
                copy(me + "linear_fc2.weight", fe + "down_proj.weight", (h, inter)),
            ]
    return table


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF q [nh*d, H], k/v [ng*d, H] -> Megatron `linear_qkv` [ng*(r+2)*d, H], r = nh/ng.

    Per query group g the rows are [q heads g*r .. g*r+r-1; k_g; v_g]. The group count is read
    from k, so this also fuses a TP shard (a contiguous block of groups) of q, k and v.
    """
    ng, hidden = k.shape[0] // head_dim, q.shape[-1]
    r = q.shape[0] // k.shape[0]
    grouped = (q.view(ng, r * head_dim, hidden), k.view(ng, head_dim, hidden), v.view(ng, head_dim, hidden))
    return torch.cat(grouped, dim=1).reshape(-1, hidden)


def split_qkv(qkv: torch.Tensor, cfg: MoEModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`: `linear_qkv` [ng*(r+2)*d, H] -> q [nh*d, H], k [ng*d, H], v [ng*d, H]."""
    d, ng, hidden = cfg.head_dim, cfg.num_query_groups, qkv.shape[-1]
    r = cfg.num_attention_heads // ng
    q, k, v = qkv.view(ng, (r + 2) * d, hidden).split([r * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def _merge(mapping: TensorMapping, parts: list[torch.Tensor], cfg: MoEModelConfig) -> torch.Tensor:
    if mapping.kind == _QKV:
        return fuse_qkv(*parts, head_dim=cfg.head_dim)
    if mapping.kind == _FC1:
        return torch.cat(parts, dim=0)
    return parts[0]


def _split(mapping: TensorMapping, tensor: torch.Tensor, cfg: MoEModelConfig) -> tuple[torch.Tensor, ...]:
    if mapping.kind == _QKV:
        return split_qkv(tensor, cfg)
    if mapping.kind == _FC1:
        return tuple(tensor.chunk(2, dim=0))
    return (tensor,)


def _megatron_shape(mapping: TensorMapping) -> tuple[int, ...]:
    """The shape `_merge` gives: fused QKV and fc1 stack their parts' rows, the rest are 1:1."""
    first = tuple(mapping.hf_shapes[0])
    if mapping.kind in (_QKV, _FC1):
        return (sum(shape[0] for shape in mapping.hf_shapes), *first[1:])
    return first


def _check_names(found: Iterable[str], expected: Iterable[str], what: str, cfg: MoEModelConfig) -> None:
    found, expected = set(found), set(expected)
    if missing := sorted(expected - found):
        raise ConversionError(f"{what} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    if extra := sorted(found - expected):
        hint = " (tie_word_embeddings=true: no separate lm_head)" if "lm_head.weight" in extra else ""
        raise ConversionError(
            f"{what} has {len(extra)} tensor(s) the architecture lacks{hint}, e.g. {extra[:3]} "
            f"(num_layers={cfg.num_layers}, num_experts={cfg.num_experts})"
        )


def _check_shape(name: str, shape: Iterable[int], expected: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(expected):
        raise ConversionError(f"{name}: shape {tuple(shape)}, expected {tuple(expected)}")


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor], model_cfg: MoEModelConfig
) -> dict[str, torch.Tensor]:
    """HF on-disk state dict -> global Megatron state dict (TP=EP=1 names and shapes).

    Raises:
        ConversionError: a tensor is missing, unexpected or mis-shaped (named in the message).
    """
    table = name_table(model_cfg)
    _check_names(hf_state, (n for t in table for n in t.hf), "HF state dict", model_cfg)
    out = {}
    for mapping in table:
        for name, shape in zip(mapping.hf, mapping.hf_shapes):
            _check_shape(name, hf_state[name].shape, shape)
        out[mapping.megatron] = _merge(mapping, [hf_state[n] for n in mapping.hf], model_cfg).contiguous()
    return out


def megatron_to_hf(
    global_state: Mapping[str, torch.Tensor], model_cfg: MoEModelConfig
) -> dict[str, torch.Tensor]:
    """Global Megatron state dict -> HF on-disk names (per-expert gate/up/down_proj).

    Raises:
        ConversionError: a tensor is missing, unexpected or mis-shaped (named in the message).
    """
    table = name_table(model_cfg)
    _check_names(global_state, (t.megatron for t in table), "Megatron state dict", model_cfg)
    out = {}
    for mapping in table:
        out.update(megatron_tensor_to_hf(mapping, global_state[mapping.megatron], model_cfg))
    return out


def megatron_tensor_to_hf(
    mapping: TensorMapping, tensor: torch.Tensor, cfg: MoEModelConfig
) -> dict[str, torch.Tensor]:
    """One global Megatron tensor -> its HF tensors by on-disk name (shape checked, TP padding dropped)."""
    if mapping.vocab_rows and tensor.shape[0] > cfg.vocab_size:
        tensor = tensor[: cfg.vocab_size]
    _check_shape(mapping.megatron, tensor.shape, _megatron_shape(mapping))
    return {name: part.contiguous() for name, part in zip(mapping.hf, _split(mapping, tensor, cfg))}


# ----------------------------------------------------------------------------- configs


def read_hf_config(hf_dir: str | os.PathLike) -> MoEModelConfig:
    """The architecture in `hf_dir/config.json` (`HFConfigError` if missing, unreadable or refused)."""
    from megatron_gspo.model.hf.config import read_hf_config as read

    return read(hf_dir)


def check_same_architecture(checkpoint: MoEModelConfig, model: MoEModelConfig, where: str) -> None:
    """Raise `ConversionError` naming every architecture field that differs."""
    diffs = [
        f"{f}: checkpoint {getattr(checkpoint, f)!r} vs model {getattr(model, f)!r}"
        for f in ARCHITECTURE_FIELDS
        if getattr(checkpoint, f) != getattr(model, f)
    ]
    if diffs:
        raise ConversionError(f"{where} does not match the model's architecture: " + "; ".join(diffs))


def built_architecture(model: torch.nn.Module, like: MoEModelConfig) -> MoEModelConfig:
    """The architecture a built GPTModel actually has (read from its TransformerConfig)."""
    from megatron_gspo.model.builder import unpadded_vocab_size

    c = model.config
    return like.replace(
        vocab_size=unpadded_vocab_size(model),
        hidden_size=c.hidden_size,
        num_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_query_groups,
        head_dim=c.kv_channels,
        num_experts=c.num_moe_experts,
        moe_topk=c.moe_router_topk,
        moe_ffn_hidden_size=c.moe_ffn_hidden_size,
        norm_topk_prob=not c.moe_router_pre_softmax,
        rms_norm_eps=c.layernorm_epsilon,
        tie_word_embeddings=model.share_embeddings_and_output_weights,
    )


# ----------------------------------------------------------------------------- import


@dataclass
class LoadStats:
    """What one rank read from the checkpoint."""

    tensors: int
    """Local Megatron tensors filled."""
    bytes_read: int
    """Bytes of HF tensor data this rank read (its experts and TP slices only)."""


class _SafetensorsReader:
    """Lazy access to the tensors of an HF checkpoint directory (one or several shards)."""

    def __init__(self, hf_dir: Path, stack: contextlib.ExitStack):
        from safetensors import safe_open

        index = hf_dir / SAFE_WEIGHTS_INDEX_NAME
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {hf_dir}")
        self.handles = {}
        for fname in files:
            handle = stack.enter_context(safe_open(str(hf_dir / fname), framework="pt"))
            self.handles.update(dict.fromkeys(handle.keys(), handle))
        self.bytes_read = 0

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[name].get_slice(name).get_shape())

    def read_rows(self, name: str, start: int, rows: int) -> torch.Tensor:
        """`rows` rows of `name` from `start`; rows past its end (Megatron's vocab padding) are zero."""
        view = self.handles[name].get_slice(name)
        size = view.get_shape()[0]
        tensor = view[min(start, size) : min(start + rows, size)]
        self.bytes_read += tensor.numel() * tensor.element_size()
        if tensor.shape[0] == rows:
            return tensor
        padding = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
        return torch.cat([tensor, padding])

    def read(self, name: str, dim: int | None = None, rank: int = 0, world: int = 1) -> torch.Tensor:
        """The whole tensor, or its `rank`-th of `world` contiguous chunks along `dim`."""
        view = self.handles[name].get_slice(name)
        if dim is None or world == 1:
            tensor = view[:]
        else:
            size = view.get_shape()[dim]
            if size % world:
                raise ConversionError(f"{name}: dim {dim} of size {size} does not split over {world} ranks")
            step = size // world
            index = [slice(None)] * dim + [slice(rank * step, (rank + 1) * step)]
            tensor = view[tuple(index)]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


@torch.no_grad()
def load_hf_checkpoint(
    model: torch.nn.Module, hf_dir: str | os.PathLike, model_cfg: MoEModelConfig | None = None
) -> LoadStats:
    """Load an HF Qwen3-MoE checkpoint directory into this rank's shard of `model` (any TP x EP x PP).

    Every rank calls it (no communication). Each rank opens the safetensors files lazily and
    reads only the tensors its shard holds: its pipeline stage's layers (the embedding on the
    first stage, the final norm and output layer on the last; a tied last stage reads the
    embedding into its output layer), its own experts, and under TP only its slice of
    each split tensor (`safe_open(...).get_slice`), so memory and I/O per rank scale with the
    shard, not the checkpoint.

    Args:
        model: Megatron GPTModel from `build_model` (or a DDP wrapper of one).
        hf_dir: Directory with config.json and safetensors shard(s) (+ index when sharded).
        model_cfg: Architecture the model was built from; default the one in config.json.
            Either way config.json and the built model are checked against each other.

    Returns:
        What this rank read.

    Raises:
        ConversionError: config.json or a tensor does not match the model, or a tensor (this
            rank's part of it) holds NaN/inf (the field/tensor is named).
    """
    hf_dir = Path(hf_dir)
    checkpoint_cfg = read_hf_config(hf_dir)
    if model_cfg is not None:
        check_same_architecture(checkpoint_cfg, model_cfg, f"{hf_dir}/config.json")
    model = unwrap_model(model)
    cfg = checkpoint_cfg
    check_same_architecture(cfg, built_architecture(model, cfg), f"{hf_dir}/config.json")
    table = {t.megatron: t for t in name_table(cfg)}
    count = 0
    with contextlib.ExitStack() as stack:
        reader = _SafetensorsReader(hf_dir, stack)
        _check_names(reader.handles, (n for t in table.values() for n in t.hf), f"checkpoint {hf_dir}", cfg)
        for global_name, target, tp_rank, tp_world in local_shard_plan(model):
            mapping = table.get(global_name)
            if mapping is None:
                raise ConversionError(f"model tensor {global_name!r} has no HF counterpart in the name table")
            for name, shape in zip(mapping.hf, mapping.hf_shapes):
                _check_shape(f"{hf_dir}: {name}", reader.shape(name), shape)
            dim = None
            if tp_world > 1:
                dim, stride = target.partition_dim, target.partition_stride
                if mapping.kind in _TP_SPLIT and (dim, stride) != _TP_SPLIT[mapping.kind]:
                    raise ConversionError(
                        f"{global_name}: TP split (dim={dim}, stride={stride}) is not the expected "
                        f"{_TP_SPLIT[mapping.kind]} the {mapping.kind} reshape commutes with"
                    )
                if mapping.kind == _COPY and stride != 1:
                    raise ConversionError(f"{global_name}: unexpected TP partition stride {stride}")
            if mapping.vocab_rows:  # megatron pads the vocabulary to a multiple of TP (x its divisor)
                rows = target.shape[0]
                parts = [reader.read_rows(mapping.hf[0], rows * tp_rank if dim == 0 else 0, rows)]
            else:
                parts = [reader.read(name, dim, tp_rank, tp_world) for name in mapping.hf]
            for name, part in zip(mapping.hf, parts):
                problem = non_finite(name, part)
                if problem is not None:
                    raise ConversionError(f"{hf_dir}: {problem}; refusing to load it")
            source = _merge(mapping, parts, cfg)
            _check_shape(f"{global_name} (TP rank {tp_rank}/{tp_world})", source.shape, tuple(target.shape))
            target.copy_(source)
            count += 1
    return LoadStats(tensors=count, bytes_read=reader.bytes_read)


# ----------------------------------------------------------------------------- parity check


def hf_token_logprobs(hf_model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs [B, T] of `tokens` [B, T] under an HF causal LM; column 0 is 0."""
    with torch.no_grad():
        logits = hf_model(input_ids=tokens).logits.double()
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def logprob_diff(
    megatron_model: torch.nn.Module,
    hf_logprobs: Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    *,
    pad_multiple: int = 1,
) -> tuple[float, float]:
    """Max and mean |log-prob difference| between the Megatron model and an HF reference.

    Args:
        megatron_model: This rank's shard (every rank of the model-parallel group calls this).
        hf_logprobs: Maps tokens [B, T] to reference log-probs [B, T] (e.g. `hf_token_logprobs`).
        tokens: [B, T] token ids.
        pad_multiple: Row-length multiple for packing (the TP size under sequence parallelism).
    """
    from megatron_gspo.model.logprobs import sequence_logprobs

    with torch.no_grad():
        ours, _ = sequence_logprobs(megatron_model, list(tokens), pad_multiple=pad_multiple)
    diff = (ours.double() - hf_logprobs(tokens))[:, 1:].abs()
    return diff.max().item(), diff.mean().item()


def random_tokens(vocab_size: int, batch: int = 4, length: int = 48, seed: int = 0) -> torch.Tensor:
    """[batch, length] uniformly random token ids (a fixed seed -> the same tokens on every rank)."""
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def main(argv: list[str] | None = None) -> int:
    """`--hf DIR --check`: load DIR into Megatron (world of one) and compare log-probs with HF."""
    parser = argparse.ArgumentParser(description="HF Qwen3-MoE <-> Megatron conversion check")
    parser.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("--check", action="store_true", help="compare per-token log-probs with transformers")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args(argv)
    if not args.check:
        parser.error("nothing to do: pass --check")
    from transformers import AutoModelForCausalLM

    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed

    try:  # what the checkpoint is, and whether it loads: one line naming the problem, exit 2
        cfg = read_hf_config(args.hf)
    except (ConfigError, OSError) as err:
        print(f"convert --check: {err}", file=sys.stderr)
        return 2
    init_distributed(ParallelConfig(), seed=args.seed)
    try:
        model = build_model(cfg, ParallelConfig()).eval()
        try:
            stats = load_hf_checkpoint(model, args.hf)
        except (ConversionError, OSError) as err:
            print(f"convert --check: {args.hf}: {err}", file=sys.stderr)
            return 2
        hf_model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
        tokens = random_tokens(cfg.vocab_size, args.batch, args.length, args.seed)
        worst, mean = logprob_diff(model, lambda t: hf_token_logprobs(hf_model, t), tokens)
    finally:
        destroy_distributed()
    ok = worst <= args.tolerance
    print(
        f"{args.hf}: loaded {stats.tensors} tensors ({stats.bytes_read / 2**20:.1f} MiB); "
        f"per-token log-prob |Megatron - HF| over {args.batch}x{args.length - 1} tokens: "
        f"max={worst:.3e} mean={mean:.3e} -> {'OK' if ok else 'FAIL'} (tolerance {args.tolerance:g})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
