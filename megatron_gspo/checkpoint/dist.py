"""Model and optimizer state through megatron's `dist_checkpointing` (torch_dist), reshardable.

Megatron describes every tensor of this rank as a `ShardedTensor`: a slice of a global tensor
with a layout-independent key (`decoder.layers.mlp.experts.experts.linear_fc1.weight`, Adam's
moments under `optimizer.state.exp_avg.<that key>`). `dist_checkpointing.save` writes the
slices in torch's distributed-checkpoint format, each rank its own files (fully parallel:
replicas are split over data-parallel ranks), and `load` reads whatever slices the loading
layout needs, so a checkpoint written at TP2 loads at EP2 or at world size 1.

What megatron's own wrappers tie to the layout is kept out of the file:
- the optimizer is one `ChainedOptimizer` leaf per parameter group kind (dense, expert), and
  how many leaves there are depends on the layout (megatron prefixes keys with `chained_<i>`
  and stores each leaf's param groups in `common.pt`). Only the leaves' sharded tensors go
  to `dist_checkpointing` (their keys and offsets are global, whichever leaf holds them); the
  one non-tensor value that must survive a resume, Adam's step count, is returned to the
  caller to store as a single number (the leaves step together), and each leaf's param groups
  are taken from the optimizer as built;
- the distributed optimizer's state is written in one of two megatron formats. Routine saves
  use `dp_reshardable`: each rank writes its own slice of the flat DP buffers as it holds
  them, with no gather and no copy beyond the write itself, but the file is tied to the bucket
  layout of this TP/EP/PP/DP layout (the loader refuses another layout, see `checkpoint`).
  Reshardable saves (on request) use `fully_reshardable`: moments and fp32 main params in model
  space (one tensor per parameter, like a plain optimizer's), loadable at any layout; saving
  all-gathers each model-parallel shard's whole optimizer state (12 bytes per parameter) into
  every DP rank's host memory (`fully_sharded_model_space`, which would not, is broken in
  megatron-core 0.16.1: "ShardedTensor.flattened_range is not supported"). With torch's Adam
  (no apex / TransformerEngine) loading it needs `patches/distributed_optimizer_reshardable_load.py`;
- `_extra_state` entries (TransformerEngine's FP8 metadata, empty in the local spec) are
  sharded per TP rank with TP-dependent keys; they are not saved, so FP8 scaling history
  restarts after a resume.
Learning-rate and weight-decay values come back through the scheduler, not these files.

Saves are synchronous. megatron offers `async_sharded_save` (the write then runs in a forked
or persistent background process driven by `AsyncCallsQueue`); it is not used: the atomic
publish (rename, `latest`) would have to move into its finalize callbacks, and it was not
verified on gloo/CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_gspo.model.chunks import model_chunks
from megatron_gspo.model.distributed import unwrap_model

ROUTINE_SHARDING = "dp_reshardable"
"""The distributed optimizer's routine format: each rank's own buffer slice, this layout only."""
RESHARDABLE_SHARDING = "fully_reshardable"
"""The distributed optimizer's reshardable format: model space, any layout (gathered on save)."""
SHARDINGS = (ROUTINE_SHARDING, RESHARDABLE_SHARDING)


def leaf_optimizers(optimizer) -> list:
    """The per-group-kind optimizers inside megatron's `ChainedOptimizer` (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed_optimizer(leaf) -> bool:
    """Whether `leaf` is megatron's DistributedOptimizer (Adam states sharded over DP)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(leaf, DistributedOptimizer)


def _model_sharded(model: torch.nn.Module) -> dict[str, Any]:
    """Megatron's sharded state dict of the model (without TransformerEngine's extra state).

    Under a virtual pipeline one per chunk (`model0`, `model1`, ...), as Megatron-LM nests them.
    The files key tensors by global names and layer offsets (each chunk's `vp_stage` places its
    layers), so any layout loads them.
    """
    chunks = model_chunks(unwrap_model(model))
    if len(chunks) > 1:
        return {f"model{c}": _chunk_sharded(chunk) for c, chunk in enumerate(chunks)}
    return _chunk_sharded(chunks[0])


def _chunk_sharded(chunk: torch.nn.Module) -> dict[str, Any]:
    sharded = chunk.sharded_state_dict()
    return {k: v for k, v in sharded.items() if not k.endswith("_extra_state")}


def _adam_step(leaf) -> int | None:
    """A leaf's step count, None before any step.

    torch's Adam keeps it per parameter (all equal), TransformerEngine's FusedAdam per group.
    """
    inner = leaf.optimizer
    steps = {int(g["step"]) for g in inner.param_groups if "step" in g and g["params"]}
    steps |= {int(s["step"]) for s in inner.state.values() if "step" in s}
    if len(steps) > 1:
        raise RuntimeError(f"optimizer parameters disagree on the step count: {sorted(steps)}")
    return steps.pop() if steps else None


def optimizer_step_count(optimizer) -> int | None:
    """Adam's step count, the same in every leaf (None before the first step)."""
    steps = {_adam_step(leaf) for leaf in leaf_optimizers(optimizer)}
    if len(steps) > 1:
        raise RuntimeError(f"optimizer leaves disagree on the step count: {steps}")
    return steps.pop()


def optimizer_has_state(optimizer) -> bool:
    """Whether any leaf holds state a freshly built optimizer lacks (Adam moments, momenta).

    None do before the first step, when the main params also still equal the weights.
    """
    return any(bool(leaf.optimizer.state) for leaf in leaf_optimizers(optimizer))


def sharded_state(
    model: torch.nn.Module, optimizer, *, loading: bool, sharding: str = RESHARDABLE_SHARDING
) -> tuple[dict[str, Any], list]:
    """The dict `dist_checkpointing` saves or fills, and each leaf's non-tensor rest.

    `sharding` (one of `SHARDINGS`) is the distributed optimizer's format; other optimizers
    always describe their state in model space.

    Returns:
        ({"model": model sharded dict, "optimizer": per leaf its sharded items}, per leaf the
        rest of its sharded state dict, which its `load_state_dict` needs back after loading).
        Only the sharded items reach the files, stored by their global keys and offsets, so the
        number of leaves and their nesting may differ between saving and loading layouts.
    """
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding, extract_sharded_base

    if sharding not in SHARDINGS:
        raise ValueError(f"optimizer sharding {sharding!r}; expected one of {SHARDINGS}")
    model_sd = _model_sharded(model)
    items, rests = [], []
    for leaf in leaf_optimizers(optimizer):
        if loading and is_distributed_optimizer(leaf) and not leaf.optimizer.state:
            _allocate_state(leaf)
        leaf_sd = leaf.sharded_state_dict(
            model_sd, is_loading=loading, metadata={"distrib_optim_sharding_type": sharding}
        )
        if is_distributed_optimizer(leaf) and sharding == ROUTINE_SHARDING:
            # Buffer keys name the leaf's model-parallel rank only: dense and expert leaves collide.
            add_prefix_for_sharding(leaf_sd, f"chained_{len(items)}.")
        sharded, rest = extract_sharded_base(leaf_sd)
        items.append(sharded)
        rests.append(rest)
    return {"model": model_sd, "optimizer": items}, rests


def _allocate_state(leaf) -> None:
    """Give a fresh DistributedOptimizer its Adam state (its `state_dict()` fails without one).

    Its `load_state_dict` allocates the state when given its own param groups and a step.
    """
    groups = [
        {k: v for k, v in g.items() if k != "params"} | {"step": 0} for g in leaf.optimizer.param_groups
    ]
    leaf.load_state_dict({"optimizer": {"param_groups": groups}})


def _parallel_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=True)


def save_sharded(
    directory: Path,
    model: torch.nn.Module,
    optimizer,
    *,
    with_optimizer: bool = True,
    sharding: str = RESHARDABLE_SHARDING,
) -> None:
    """Write model and optimizer tensors into `directory` (collective; the directory must exist).

    Args:
        directory: the `dist_checkpointing` directory.
        model: this rank's model shard (DDP-wrapped or bare).
        optimizer: megatron's optimizer.
        with_optimizer: False before the optimizer's first step (see `optimizer_has_state`):
            megatron cannot describe state that does not exist yet, so only the model is written.
        sharding: the distributed optimizer's format (`ROUTINE_SHARDING` or `RESHARDABLE_SHARDING`).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    if with_optimizer:
        state, _ = sharded_state(model, optimizer, loading=False, sharding=sharding)
    else:
        state = {"model": _model_sharded(model)}
    base = get_default_save_sharded_strategy("torch_dist")
    strategy = FullyParallelSaveStrategyWrapper(base, _parallel_group())
    dist_checkpointing.save(state, str(directory), strategy)


def load_sharded(
    directory: Path,
    model: torch.nn.Module,
    optimizer,
    step: int | None,
    *,
    with_optimizer: bool = True,
    sharding: str = RESHARDABLE_SHARDING,
) -> None:
    """Fill model and optimizer from `directory`, whatever layout wrote it (collective).

    Args:
        directory: the `dist_checkpointing` directory.
        model: this rank's model shard (DDP-wrapped or bare).
        optimizer: megatron's optimizer, built as for a fresh run.
        step: Adam's step count recorded at save time (None: the optimizer had not stepped).
        with_optimizer: whether the directory holds optimizer state; without it the optimizer
            stays as built (it had not stepped when saved), its main params taken from the weights.
        sharding: the distributed optimizer's format the directory was written in.
    """
    if not with_optimizer:
        load_model_sharded(directory, model)
        optimizer.reload_model_params()  # fp32 main params of a bf16 model: copies of the loaded weights
        return
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    state, rests = sharded_state(model, optimizer, loading=True, sharding=sharding)
    base = get_default_load_sharded_strategy(str(directory))
    strategy = FullyParallelLoadStrategyWrapper(base, _parallel_group())
    loaded = dist_checkpointing.load(state, str(directory), strategy)
    _load_model(model, loaded["model"])
    for leaf, rest, tensors in zip(leaf_optimizers(optimizer), rests, loaded["optimizer"]):
        # Values marked local and non-persistent (this run's own param-group layout) are used as built.
        rest = dict_list_map_inplace(
            lambda v: v.unwrap() if isinstance(v, LocalNonpersistentObject) else v, rest
        )
        filled = merge(rest, tensors)
        _set_step(filled, step, is_distributed_optimizer(leaf))
        if is_distributed_optimizer(leaf) and sharding == ROUTINE_SHARDING and step is not None:
            _set_bucket_steps(filled["param_state"], step)
        with torch.no_grad():  # distributed optimizer: main params are views of model parameters
            leaf.load_state_dict(filled)
        _drop_group_steps(leaf)


def load_model_sharded(directory: Path, model: torch.nn.Module) -> None:
    """Fill only the model from `directory` (export, analysis), whatever layout wrote it (collective)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    model_sd = _model_sharded(model)
    base = get_default_load_sharded_strategy(str(directory))
    strategy = FullyParallelLoadStrategyWrapper(base, _parallel_group())
    loaded = dist_checkpointing.load({"model": model_sd}, str(directory), strategy)
    _load_model(model, loaded["model"])


def _load_model(model: torch.nn.Module, state: dict[str, Any]) -> None:
    chunks = model_chunks(unwrap_model(model))
    if len(chunks) > 1:
        for c, chunk in enumerate(chunks):
            _load_chunk(chunk, state[f"model{c}"])
    else:
        _load_chunk(chunks[0], state)


def _load_chunk(chunk: torch.nn.Module, state: dict[str, Any]) -> None:
    result = chunk.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        unexpected = result.unexpected_keys[:3]
        raise RuntimeError(f"model state mismatch: missing {missing[:3]}, unexpected {unexpected}")


def _set_step(leaf_state: dict[str, Any], step: int | None, distributed: bool) -> None:
    """Put the saved step count where the leaf's `load_state_dict` reads it (None: leave as built)."""
    if step is None:
        return
    if distributed:
        for group in leaf_state["optimizer"]["param_groups"]:
            group["step"] = step
        return
    state = leaf_state["optimizer"]["state"] if "optimizer" in leaf_state else leaf_state["state"]
    state["common_step"] = torch.tensor(float(step))


def _drop_group_steps(leaf) -> None:
    """Leave a step count only where the inner optimizer advances it (as in a run never resumed).

    Megatron's DistributedOptimizer hands its saved param groups, `step` included, to torch's
    Adam, which keeps the key but counts per parameter: the group copy would stay at the resumed
    step while the parameters' counts advance, and the next save would find them apart.
    TE/apex FusedAdam count per group and keep no per-parameter step; theirs stays.
    """
    inner = leaf.optimizer
    if any("step" in s for s in inner.state.values()):
        for group in inner.param_groups:
            group.pop("step", None)


def _set_bucket_steps(param_state: Any, step: int) -> None:
    """Put the saved step count into each bucket entry of a `dp_reshardable` state.

    Megatron keeps torch Adam's per-parameter step out of the file (a local, non-persistent
    value captured from the freshly allocated state) and copies it back over the loaded state.
    """
    if isinstance(param_state, dict):
        if isinstance(param_state.get("step"), torch.Tensor):
            param_state["step"] = torch.full_like(param_state["step"], float(step))
        values = param_state.values()
    elif isinstance(param_state, list):
        values = param_state
    else:
        return
    for value in values:
        _set_bucket_steps(value, step)
