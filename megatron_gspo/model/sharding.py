"""Global (unsharded, world-size-1) Megatron state dicts <-> this rank's TP/EP shard.

A *global* state dict uses the names and shapes of the model built at TP=EP=1: experts are
`...local_experts.{e}` with the global expert index e, tensors unsplit. Megatron marks
every tensor-parallel parameter with `tensor_model_parallel`, `partition_dim` and
`partition_stride` (2 for SwiGLU fc1, whose shards are [gate_r; up_r]); expert parameters
(`allreduce=False`) are split over the expert-TP group, the rest over the TP group. Under
EP, global expert `ep_rank * num_local_experts + i` is local expert i.

Names are those of megatron's local layer spec; the TransformerEngine spec's names (input
norm fused into `linear_qkv.layer_norm_weight`, grouped-GEMM experts `experts.linear_fc1.weight{e}`)
are mapped to them by `canonical_name`, so global state dicts and HF conversion are the same
whichever spec built the model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

_LOCAL_EXPERT = re.compile(r"(.*\.local_experts\.)(\d+)(\..*)")
# TransformerEngine layer-spec names -> local-spec names.
_TE_NAMES = (
    (re.compile(r"(.*)\.self_attention\.linear_qkv\.layer_norm_weight$"), r"\1.input_layernorm.weight"),
    (
        re.compile(r"(.*)\.mlp\.experts\.linear_fc([12])\.weight(\d+)$"),
        r"\1.mlp.experts.local_experts.\3.linear_fc\2.weight",
    ),
)


class ShardingError(ValueError):
    """A global state dict does not fit the model (missing, unexpected or mis-shaped tensors)."""


def _is_expert(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


def _tp_group(param: torch.Tensor):
    from megatron.core import parallel_state as ps

    if _is_expert(param):
        return ps.get_expert_tensor_parallel_group()
    return ps.get_tensor_model_parallel_group()


def _expert_layout() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()


def canonical_name(name: str) -> str:
    """A parameter's local-layer-spec name (TransformerEngine spec names are translated)."""
    for pattern, replacement in _TE_NAMES:
        if pattern.match(name):
            return pattern.sub(replacement, name)
    return name


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):  # megatron DDP / Float16Module wrappers
        model = model.module
    return model


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by canonical name, without `_extra_state` entries."""
    model = _unwrap(model)
    named = {canonical_name(n): p for n, p in model.named_parameters()}
    for name, value in model.state_dict(keep_vars=True).items():
        name = canonical_name(name)
        if name not in named and torch.is_tensor(value) and not name.endswith("_extra_state"):
            named[name] = value
    return named


class LocalTensor(NamedTuple):
    """One tensor of this rank's shard and where it sits in the global state dict."""

    global_name: str
    tensor: torch.Tensor
    tp_rank: int
    tp_world: int


def local_shard_plan(model: torch.nn.Module) -> Iterator[LocalTensor]:
    """Every tensor of this rank's shard with its global name and TP position (no communication)."""
    named = _named_tensors(model)
    ep_rank, _ = _expert_layout()
    n_local = _num_local_experts(named)
    for local_name, tensor in named.items():
        tp_rank, tp_world = 0, 1
        if getattr(tensor, "tensor_model_parallel", False):
            group = _tp_group(tensor)
            tp_rank, tp_world = group.rank(), group.size()
        yield LocalTensor(to_global_name(local_name, ep_rank, n_local), tensor, tp_rank, tp_world)


def _num_local_experts(names) -> int:
    ids = {int(m.group(2)) for n in names if (m := _LOCAL_EXPERT.match(n))}
    return max(ids) + 1 if ids else 0


def to_global_name(local_name: str, ep_rank: int, num_local_experts: int) -> str:
    """`...local_experts.{i}...` on EP rank r -> `...local_experts.{r * E_local + i}...`."""
    match = _LOCAL_EXPERT.match(local_name)
    if not match:
        return local_name
    return f"{match.group(1)}{ep_rank * num_local_experts + int(match.group(2))}{match.group(3)}"


def _split(tensor: torch.Tensor, dim: int, stride: int, rank: int, world: int) -> torch.Tensor:
    chunks = torch.chunk(tensor, stride * world, dim=dim)
    return torch.cat(chunks[rank::world], dim=dim)


def _merge(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    per_shard = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([per_shard[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


def load_global_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy this rank's shard of a global state dict into `model` (every rank calls it)."""
    named = _named_tensors(model)
    ep_rank, _ = _expert_layout()
    n_local = _num_local_experts(named)
    wanted = {}
    for local_name, target in named.items():
        global_name = to_global_name(local_name, ep_rank, n_local)
        if global_name not in state:
            raise ShardingError(f"global state dict has no tensor {global_name!r} (for local {local_name!r})")
        wanted[global_name] = target
    expected_experts = n_local * _expert_layout()[1]
    extra = [n for n in state if n not in wanted and not _belongs_to_other_ep_rank(n, expected_experts)]
    if extra:
        raise ShardingError(f"global state dict has tensors the model lacks: {sorted(extra)[:5]}")
    with torch.no_grad():
        for global_name, target in wanted.items():
            source = state[global_name]
            if getattr(target, "tensor_model_parallel", False):
                group = _tp_group(target)
                source = _split(
                    source, target.partition_dim, target.partition_stride, group.rank(), group.size()
                )
            if source.shape != target.shape:
                raise ShardingError(
                    f"{global_name}: global shard shape {tuple(source.shape)} != local {tuple(target.shape)}"
                )
            target.copy_(source)


def _belongs_to_other_ep_rank(name: str, total_experts: int) -> bool:
    match = _LOCAL_EXPERT.match(name)
    return bool(match) and int(match.group(2)) < total_experts


def iter_global_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (global name, full tensor) for every tensor of the model, on every rank.

    Collective: all ranks must iterate it to the end together. Tensors are gathered one at a
    time, so peak memory is one full tensor (expert tensors: one per EP rank).
    """
    from megatron.core import parallel_state as ps

    named = _named_tensors(model)
    ep_rank, ep_world = _expert_layout()
    n_local = _num_local_experts(named)
    for local_name, param in named.items():
        tensor = param.detach()
        if getattr(param, "tensor_model_parallel", False):
            group = _tp_group(param)
            if group.size() > 1:
                shards = [torch.empty_like(tensor) for _ in range(group.size())]
                dist.all_gather(shards, tensor.contiguous(), group=group)
                tensor = _merge(shards, param.partition_dim, param.partition_stride)
        if _LOCAL_EXPERT.match(local_name) and ep_world > 1:
            shards = [torch.empty_like(tensor) for _ in range(ep_world)]
            dist.all_gather(shards, tensor.contiguous(), group=ps.get_expert_model_parallel_group())
            for rank, shard in enumerate(shards):
                yield to_global_name(local_name, rank, n_local), shard
        else:
            yield to_global_name(local_name, ep_rank, n_local), tensor


def gather_global_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole global state dict on every rank (small models, tests, parity checks)."""
    return {name: tensor.clone() for name, tensor in iter_global_tensors(model)}
