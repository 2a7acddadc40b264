"""Uneven all-gather / reduce-scatter along the first dim, for gloo.

With TP > 1 and EP > 1 the alltoall dispatcher gathers and scatters *different* token
counts per rank over the expert-TP group via `all_gather(list)` / `reduce_scatter(list)`,
which only NCCL supports. On gloo: pad every shard to the largest size and all-gather, and
all-reduce the whole buffer then keep this rank's slice. Same values, more bytes; CPU only.
"""

import inspect

import torch
import torch.distributed as dist
from packaging.specifiers import SpecifierSet

from ._base import Patch, require


def _check() -> None:
    from megatron.core.tensor_parallel import mappings

    for name, arg in (
        ("_gather_along_first_dim", "output_split_sizes"),
        ("_reduce_scatter_along_first_dim", "input_split_sizes"),
    ):
        params = list(inspect.signature(getattr(mappings, name)).parameters)
        require(
            params == ["input_", "group", arg, "use_global_buffer"],
            "gloo_uneven_collectives",
            f"{name} signature {params}",
        )


def _apply() -> None:
    from megatron.core.tensor_parallel import mappings

    original_gather = mappings._gather_along_first_dim
    original_reduce_scatter = mappings._reduce_scatter_along_first_dim

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        padded = input_.new_zeros((max(sizes),) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        shards = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(shards, padded, group=group)
        return torch.cat([shard[:size] for shard, size in zip(shards, sizes)], dim=0)

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(s) for s in input_split_sizes]
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start : start + sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter


PATCH = Patch(
    name="gloo_uneven_collectives",
    fixes="TP x EP alltoall dispatch gathers uneven shards, which gloo cannot",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="cpu",
    check=_check,
    apply=_apply,
)
