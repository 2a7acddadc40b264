"""Global (unsharded, world-size-1) Megatron state dicts <-> this rank's TP/EP/PP shard.

A *global* state dict uses the names and shapes of the model built at TP=EP=PP=1: layers are
`decoder.layers.{l}` with the global layer index l, experts `...local_experts.{e}` with the
global expert index e, tensors unsplit. Under pipeline parallelism a stage's module numbers its
layers from 0; each `TransformerLayer` knows its global `layer_number` (megatron adds the
stage's offset, uneven first/last stages included), which is what names it here. The
embedding lives on the first stage, the final norm and output layer on the last; with tied
embeddings the last stage's `output_layer.weight` is a replica of the global
`embedding.word_embeddings.weight` (loaded from it, never yielded twice). Megatron marks
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

from megatron_gspo.model.chunks import model_chunks
from megatron_gspo.model.distributed import unwrap_model

_LOCAL_EXPERT = re.compile(r"(.*\.local_experts\.)(\d+)(\..*)")
_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
_EMBEDDING = "embedding.word_embeddings.weight"
# GPTModel's tensors outside the layers, by the pipeline stage that holds them.
_FIRST_STAGE_PREFIXES = ("embedding.",)
_LAST_STAGE_PREFIXES = ("decoder.final_layernorm.", "output_layer.")
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


def _stage_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """This stage's unwrapped `GPTModel`s: its virtual-pipeline chunks in order, or the one model."""
    return model_chunks(unwrap_model(model))


def _layer_numbers(model: torch.nn.Module) -> dict[int, int]:
    """A chunk's module index of each transformer layer -> its global (0-based) layer index."""
    layers = getattr(getattr(model, "decoder", None), "layers", None) or []
    return {i: layer.layer_number - 1 for i, layer in enumerate(layers)}


def _is_tied_replica(model: torch.nn.Module) -> bool:
    """Whether this stage's output layer is a copy of the first stage's embedding (tied, PP > 1)."""
    return any(
        getattr(m, "share_embeddings_and_output_weights", False)
        and getattr(m, "post_process", True)
        and not getattr(m, "pre_process", True)
        for m in _stage_modules(model)
    )


def _global_layer_name(name: str, layer_numbers: dict[int, int]) -> str:
    match = _LAYER.match(name)
    if not match:
        return name
    return f"{match.group(1)}{layer_numbers[int(match.group(2))]}{match.group(3)}"


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by canonical name with global layer numbers.

    `_extra_state` entries are left out. A tied last stage's `output_layer.weight` is listed
    under the embedding's name (it holds the same global tensor). Virtual-pipeline chunks are
    listed in order, each under its own layers' global numbers.
    """
    named = {}
    for chunk in _stage_modules(model):
        named.update(_chunk_named_tensors(chunk))
    return named


def _chunk_named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    layer_numbers = _layer_numbers(model)
    tied_replica = bool(getattr(model, "share_embeddings_and_output_weights", False)) and not getattr(
        model, "pre_process", True
    )

    def rename(name: str) -> str:
        name = _global_layer_name(canonical_name(name), layer_numbers)
        return _EMBEDDING if tied_replica and name == "output_layer.weight" else name

    named = {rename(n): p for n, p in model.named_parameters()}
    for name, value in model.state_dict(keep_vars=True).items():
        name = rename(name)
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
    elsewhere = _held_elsewhere(_stage_modules(model), named, n_local * _expert_layout()[1])
    extra = [n for n in state if n not in wanted and not elsewhere(n)]
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


def _held_elsewhere(modules: list[torch.nn.Module], named: dict[str, torch.Tensor], total_experts: int):
    """A predicate: does a global name belong to another EP rank's experts or another PP stage?

    Another stage's layers are recognised by their layer-relative name (every layer holds the
    same tensors), the embedding / final norm / output layer by the stage that holds them.
    """
    own_layers, own_kinds = set(), set()
    for name in named:
        if match := _LAYER.match(name):
            own_layers.add(int(match.group(2)))
            own_kinds.add(_expert_kind(match.group(3)))
    other_stage_prefixes = ()
    if not any(getattr(m, "pre_process", True) for m in modules):
        other_stage_prefixes += _FIRST_STAGE_PREFIXES
    if not any(getattr(m, "post_process", True) for m in modules):
        other_stage_prefixes += _LAST_STAGE_PREFIXES

    def elsewhere(name: str) -> bool:
        layer = _LAYER.match(name)
        if not layer:
            return name.startswith(other_stage_prefixes)
        expert = _LOCAL_EXPERT.match(name)
        if expert and int(expert.group(2)) >= total_experts:
            return False
        other_layer = int(layer.group(2)) not in own_layers
        return (other_layer or bool(expert)) and _expert_kind(layer.group(3)) in own_kinds

    return elsewhere


def _expert_kind(layer_relative: str) -> str:
    """A layer-relative name with its expert index replaced by 0 (compares experts by kind)."""
    return _LOCAL_EXPERT.sub(r"\g<1>0\g<3>", layer_relative)


def _on_rank0_path() -> tuple[bool, bool]:
    """Whether this rank holds shards of the replica global rank 0 gathers: (dense, expert).

    Dense tensors are gathered from data-parallel replica 0 (rank 0's TP group), expert tensors
    from expert-data-parallel replica 0 (rank 0's EP x expert-TP groups); under pipeline
    parallelism the same holds on every stage.
    """
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        return True, True
    return ps.get_data_parallel_rank() == 0, ps.get_expert_data_parallel_rank() == 0


def _iter_stage_tensors(model: torch.nn.Module, to_rank0: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(global name, full tensor) for every tensor of this pipeline stage, gathered over TP and EP.

    Collective over this stage's TP and EP groups. A tied last stage's copy of the embedding
    is skipped (the first stage yields it). With `to_rank0`, only the tensors of the replica
    rank 0 gathers (`_on_rank0_path`): the rest are neither gathered nor yielded.
    """
    from megatron.core import parallel_state as ps

    named = _named_tensors(model)
    ep_rank, ep_world = _expert_layout()
    n_local = _num_local_experts(named)
    skip_replica = _is_tied_replica(model)
    dense_path, expert_path = _on_rank0_path() if to_rank0 else (True, True)
    for local_name, param in named.items():
        if skip_replica and local_name == _EMBEDDING:
            continue
        if not (expert_path if _is_expert(param) else dense_path):
            continue
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


class _GlobalTensorInfo(NamedTuple):
    """What a rank of another stage needs to receive one global tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _stage_manifest(model: torch.nn.Module) -> list[_GlobalTensorInfo]:
    """The global tensors `_iter_stage_tensors` yields on this stage, in order (no communication)."""
    named = _named_tensors(model)
    ep_rank, ep_world = _expert_layout()
    n_local = _num_local_experts(named)
    skip_replica = _is_tied_replica(model)
    manifest = []
    for local_name, param in named.items():
        if skip_replica and local_name == _EMBEDDING:
            continue
        shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            shape[param.partition_dim] *= _tp_group(param).size()
        ranks = range(ep_world) if _LOCAL_EXPERT.match(local_name) else [ep_rank]
        manifest += [
            _GlobalTensorInfo(to_global_name(local_name, r, n_local), tuple(shape), param.dtype)
            for r in ranks
        ]
    return manifest


def _stage_manifests(model: torch.nn.Module, in_rank0_group: bool) -> list[list[_GlobalTensorInfo]]:
    """Every stage's manifest in stage order, on every rank (control plane).

    Every pipeline group holds the same stages, so global rank 0's group alone describes them.
    """
    from megatron.core import parallel_state as ps

    from megatron_gspo.model import control_plane

    mine = (ps.get_pipeline_model_parallel_rank(), _stage_manifest(model)) if in_rank0_group else None
    return [manifest for _, manifest in sorted(m for m in control_plane.all_gather_objects(mine) if m)]


def iter_global_tensors(
    model: torch.nn.Module, *, to_rank0: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (global name, full tensor) for every tensor of the model, on every rank.

    Collective: all ranks must iterate it to the end together. Tensors are gathered one at a
    time over TP and EP (peak memory: one full tensor; expert tensors: one per EP rank). Under
    pipeline parallelism the stages take turns in order: the owning stage gathers a tensor and
    broadcasts it over each pipeline group, so every rank sees every tensor, one at a time,
    received on the compute device; no rank ever holds another stage's weights at once.

    With `to_rank0` only global rank 0 gets every tensor (the weight sync's sender, an export's
    writer): only the ranks holding shards of the replica it gathers take part, and only rank
    0's pipeline group receives other stages' tensors. Other ranks yield a subset or nothing
    and move no weight bytes: at DP x EP replicas, one replica's worth of traffic instead of all.
    """
    from megatron.core import parallel_state as ps

    from megatron_gspo.model.distributed import compute_device

    if ps.get_pipeline_model_parallel_world_size() == 1:
        yield from _iter_stage_tensors(model, to_rank0)
        return
    group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(group)  # in stage order
    stage = ps.get_pipeline_model_parallel_rank()
    manifests = _stage_manifests(model, 0 in pp_ranks)  # control plane: every rank takes part
    own = _iter_stage_tensors(model, to_rank0)
    if to_rank0 and 0 not in pp_ranks:  # this stage's gathers feed rank 0's pipeline group only
        yield from own
        return
    for source, manifest in enumerate(manifests):
        for info in manifest:
            if source == stage:
                name, tensor = next(own)
                if name != info.name:
                    raise ShardingError(
                        f"stage {stage} yields {name!r} where its manifest says {info.name!r}"
                    )
                tensor = tensor.contiguous()
            else:
                tensor = torch.empty(info.shape, dtype=info.dtype, device=compute_device())
            dist.broadcast(tensor, src=pp_ranks[source], group=group)
            yield info.name, tensor
    if next(own, None) is not None:
        raise ShardingError(f"stage {stage} holds tensors beyond its manifest")


def gather_global_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole global state dict on every rank (small models, tests, parity checks)."""
    return {name: tensor.clone() for name, tensor in iter_global_tensors(model)}
