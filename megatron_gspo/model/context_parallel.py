"""Context parallelism: which positions of a THD row each context-parallel rank computes.

Megatron's load-balanced split (TransformerEngine's `thd_get_partitioned_indices`, used by
megatron's `get_batch_on_this_cp_rank` for packed sequences): every sequence of the row,
padded to a multiple of 2·CP, is cut into 2·CP equal chunks and CP rank r takes chunks r and
2·CP-1-r, so under the causal mask each rank gets as much attention work as any other. The
rank's local row is, sequence after sequence, its two chunks in that order: sequence s starts
at `cu_seqlens_padded[s] / CP` locally.

Everything per position that enters the model (tokens, position ids, labels) and every
per-token routing target (R3 replay) is cut with the same index (`partition_index`). The
log-probs and entropies the model returns for the local positions are gathered over the CP
group back into row order (`gather_positions`), so the loss sees the whole row on every CP
rank and its per-token tensors (advantages, masks, old and rollout log-probs) need no cut;
the gather's backward hands each rank the gradient of its own positions only, and each CP
rank's parameter gradients cover its own tokens (megatron's DDP sums them over DP x CP).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ContextParallelError(ValueError):
    """A row cannot be split over the context-parallel ranks."""


def partition_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Row positions CP rank `cp_rank` computes, in its local order: [L / cp_size] int64.

    Args:
        cu_seqlens_padded: [B + 1] offsets of the padded sequences in the row (ends at L).
        cp_size: context-parallel ranks.
        cp_rank: this rank among them.

    Raises:
        ContextParallelError: a padded sequence length is not a multiple of 2 x cp_size.
    """
    if not 0 <= cp_rank < cp_size:
        raise ContextParallelError(f"context-parallel rank {cp_rank} outside [0, {cp_size})")
    cu = cu_seqlens_padded.to("cpu", torch.int64)
    lengths = cu.diff()
    if bool((lengths % (2 * cp_size)).any()):
        bad = int(lengths[(lengths % (2 * cp_size)) != 0][0])
        raise ContextParallelError(
            f"a padded sequence of {bad} positions does not split into 2 x context_parallel = "
            f"{2 * cp_size} chunks (pack with pad_multiple a multiple of 2 x CP x TP)"
        )
    chunk = lengths // (2 * cp_size)  # [B]
    # Per sequence: chunk r, then chunk 2·CP-1-r, each `chunk` positions long.
    first = cu[:-1] + cp_rank * chunk
    second = cu[:-1] + (2 * cp_size - 1 - cp_rank) * chunk
    starts = torch.stack([first, second], dim=1).reshape(-1)  # [2B]
    counts = chunk.repeat_interleave(2)
    offsets = torch.cumsum(counts, 0) - counts
    within = torch.arange(int(counts.sum())) - offsets.repeat_interleave(counts)
    return starts.repeat_interleave(counts) + within


def restore_order(local: list[torch.Tensor], cu_seqlens_padded: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every CP rank's local values (rank order) -> the row, in position order along `dim`."""
    cp_size = len(local)
    index = torch.cat([partition_index(cu_seqlens_padded, cp_size, r) for r in range(cp_size)])
    stacked = torch.cat(local, dim=dim)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel())
    return stacked.index_select(dim, inverse.to(stacked.device))


class _GatherPositions(torch.autograd.Function):
    """All-gather local positions over the CP group into row order; backward: own positions' grad."""

    @staticmethod
    def forward(ctx, local, cu_seqlens_padded, index, group):
        cp_size = dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(cp_size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.save_for_backward(index)
        return restore_order(parts, cu_seqlens_padded, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        # Every CP rank computes the same loss from the same gathered row: its gradient with
        # respect to this rank's positions is already here, nothing to reduce.
        return grad.index_select(-1, index.to(grad.device)), None, None, None


def gather_positions(
    local: torch.Tensor, cu_seqlens_padded: torch.Tensor, index: torch.Tensor, group
) -> torch.Tensor:
    """[..., L / CP] values of this rank's positions -> [..., L] in row order (differentiable).

    Args:
        local: per-position values of this rank (last dim in `index`'s order).
        cu_seqlens_padded: [B + 1] the row's padded sequence offsets.
        index: this rank's `partition_index`.
        group: the context-parallel process group.
    """
    return _GatherPositions.apply(local, cu_seqlens_padded, index, group)


def context_parallel_state() -> tuple[int, int, object]:
    """(CP size, CP rank, CP group) from megatron's parallel state ((1, 0, None) before it exists)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0, None
    size = ps.get_context_parallel_world_size()
    if size == 1:
        return 1, 0, None
    return size, ps.get_context_parallel_rank(), ps.get_context_parallel_group()
