"""Runtime patches to megatron-core, one file per patch, applied once per process.

`apply_patches()` decides per patch from the installed megatron-core version, whether CUDA
is available and whether TransformerEngine imports: CPU patches never touch a GPU node,
patches for bugs fixed upstream are skipped, and a version outside a patch's verified range
is refused with an error that says so. Call it before building any Megatron model (the
runtime in `megatron_gspo.model.distributed` does, in every worker).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging

import torch

from . import (
    alltoall_split_sizes,
    cuda_device,
    cuda_streams,
    cuda_tensors_to_cpu,
    dist_checkpoint_results_queue,
    distributed_optimizer_reshardable_load,
    distributed_optimizer_step,
    foreach_multi_tensor,
    gloo_uneven_collectives,
    grouped_local_experts,
    native_clip_grads,
    pipeline_shape_exchange,
    rng_tracker,
    schedule_token_counter,
    single_rank_all_reduce,
    te_general_gemm,
    torch_norm_sequence_parallel,
)
from ._base import Patch, PatchError, megatron_core_version

__all__ = ["PATCHES", "Patch", "PatchError", "apply_patches", "applied_patches"]

log = logging.getLogger(__name__)

PATCHES: tuple[Patch, ...] = tuple(
    module.PATCH
    for module in (
        cuda_device,
        cuda_streams,
        rng_tracker,
        te_general_gemm,
        torch_norm_sequence_parallel,
        alltoall_split_sizes,
        gloo_uneven_collectives,
        cuda_tensors_to_cpu,
        schedule_token_counter,
        distributed_optimizer_step,
        distributed_optimizer_reshardable_load,
        dist_checkpoint_results_queue,
        foreach_multi_tensor,
        grouped_local_experts,
        single_rank_all_reduce,
        native_clip_grads,
        pipeline_shape_exchange,
    )
)

_decisions: dict[str, str] | None = None


@functools.cache
def transformer_engine_available() -> bool:
    """Whether TransformerEngine imports (decides the layer spec and some patches).

    Imported, not only found: an installed TE built for another CUDA or torch fails at import
    (a missing shared library, an undefined symbol); the run then takes the local spec, and
    the failure is logged once so that a GPU run without TE does not go unnoticed.
    """
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as err:  # noqa: BLE001 - ImportError, OSError of a .so, RuntimeError of its checks
        if importlib.util.find_spec("transformer_engine") is not None:
            log.warning(
                "transformer_engine is installed but does not import (%s: %s)", type(err).__name__, err
            )
        return False
    return True


def apply_patches(*, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Apply every patch this process needs, once. Returns {patch name: 'applied' | why skipped}.

    Args:
        skip: patch names not to apply (tests use it to show a patch is still needed).
    """
    global _decisions
    if _decisions is not None:
        return _decisions
    unknown = set(skip) - {p.name for p in PATCHES}
    if unknown:
        raise PatchError(f"unknown patch names {sorted(unknown)}; known: {[p.name for p in PATCHES]}")
    version = megatron_core_version()
    cpu, have_te = not torch.cuda.is_available(), transformer_engine_available()
    decisions = {}
    for patch in PATCHES:
        decision = (
            "skipped: asked to" if patch.name in skip else patch.decide(version, cpu=cpu, have_te=have_te)
        )
        if decision == "apply":
            patch.apply()
            decision = "applied"
        decisions[patch.name] = decision
        log.debug("megatron-core %s patch %s: %s", version, patch.name, decision)
    _decisions = decisions
    return decisions


def applied_patches() -> dict[str, str]:
    """Decisions of the `apply_patches()` call of this process ({} before it)."""
    return dict(_decisions or {})
