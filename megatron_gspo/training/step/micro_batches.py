"""Which rows of a step's batch each data-parallel rank trains on, cut into which micro-batches.

Rank 0 decides for every rank from the row lengths alone (`split_batch`) and sends each rank
its rows with the cut (`step.scatter`); the ranks only pack. Mini-batch m is the rows
`[m * size, (m + 1) * size)` of the batch (one optimizer step each). Two ways to cut it:

- by count (`trainer.micro_batch_size`, 0: a rank's whole mini-batch): rank r of D takes rows
  `r, r + D, ...` of the mini-batch (`dp_rows`), in micro-batches of that many responses.
- by tokens (`trainer.max_tokens_per_micro_batch`): reasoning responses run from hundreds to
  tens of thousands of tokens, so a fixed response count either wastes the GPU or runs out
  of memory. A micro-batch costs the positions its packing occupies (`packed_size`: prompt +
  response of each row, padded as the layout pads) and never exceeds the budget. The
  mini-batch's rows go into C micro-batches of nearly equal cost (sorted greedy,
  `balanced_partition`): C starts at the smallest multiple of D that could hold the
  mini-batch's cost and grows by D until every micro-batch fits. The C micro-batches go to
  the ranks C / D each, again balancing cost, so the rows are balanced by tokens rather than
  strided. A row that alone exceeds the budget is an error rather than a micro-batch of its
  own: the budget is a memory limit, and config validation already refuses a budget below
  the longest possible row, so only a config/data mismatch can reach it.

Under the alltoall dispatcher each micro-batch keeps its own shape. Under allgather,
`uniform_shape` pads it to its expert-parallel peers' shape: for THD the longest of their totals
(within the budget); for the mask layout (CPU) the most rows times the longest row, which can
exceed it.

Every rank runs the same number of micro-batches per mini-batch: the ranks of an
expert-parallel group exchange tokens in every forward and backward (and, under allgather,
`uniform_shape` agrees on a shape per micro-batch), so a rank with one fewer would leave its peers waiting.
Rank 0 sees every row, so equal counts hold by construction (C is a multiple of D and every
micro-batch holds a row): no collective over counts and no empty micro-batches, which would
still cost a forward padded to the peers' shape and which the loss refuses (no response tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_gspo.model.packing import packed_size
from megatron_gspo.training.step.balance import balanced_partition

# One rank's cut of a batch: per mini-batch, per micro-batch, the batch rows (ascending).
RankSplit = list[list[list[int]]]


@dataclass
class DataLayout:
    """Where this rank sits among the data-parallel ranks and how it cuts its rows.

    Attributes:
        dp_rank: this rank's data-parallel index.
        dp_size: data-parallel ranks.
        micro_batch_size: responses per forward/backward (0: the rank's whole mini-batch).
        pad_multiple: packed row length (mask) / sequence length (thd) multiple: the TP size
            under sequence parallelism, x 2·CP with context parallelism (`ParallelConfig.pad_multiple`).
        packing: "mask" (local spec) or "thd" (TransformerEngine): `packing_layout(model)`.
        max_tokens_per_micro_batch: positions per micro-batch (0: cut by `micro_batch_size`);
            rows are then balanced over the ranks by tokens.
    """

    dp_rank: int = 0
    dp_size: int = 1
    micro_batch_size: int = 0
    pad_multiple: int = 1
    packing: str = "mask"
    max_tokens_per_micro_batch: int = 0

    @classmethod
    def from_megatron(
        cls,
        micro_batch_size: int,
        pad_multiple: int,
        packing: str = "mask",
        max_tokens_per_micro_batch: int = 0,
    ) -> DataLayout:
        """The layout of the current process from megatron's parallel state."""
        from megatron.core import parallel_state as ps

        return cls(
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            micro_batch_size=micro_batch_size,
            pad_multiple=pad_multiple,
            packing=packing,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch,
        )

    def cost(self, lengths: list[int]) -> int:
        """Positions a micro-batch of rows of these lengths (prompt + response) occupies."""
        return packed_size(lengths, layout=self.packing, pad_multiple=self.pad_multiple)


def _mini_batch_size(batch_size: int, num_mini_batches: int, dp_size: int) -> int:
    """Rows per mini-batch; raises ValueError unless they split evenly over the DP ranks."""
    size = batch_size // num_mini_batches if num_mini_batches > 0 else 0
    if num_mini_batches < 1 or size * num_mini_batches != batch_size or size % dp_size:
        raise ValueError(
            f"{batch_size} responses do not split into {num_mini_batches} mini-batches x "
            f"{dp_size} data-parallel ranks"
        )
    return size


def dp_rows(batch_size: int, num_mini_batches: int, dp_rank: int, dp_size: int) -> list[int]:
    """Rows of a `batch_size`-row batch that data-parallel rank `dp_rank` trains on, by count.

    Mini-batch m is rows `[m * size, (m + 1) * size)`; the rank takes every `dp_size`-th of
    them starting at `dp_rank`. The result lists mini-batch 0's rows, then mini-batch 1's, ...

    Raises:
        ValueError: the rows do not split evenly into mini-batches x data-parallel ranks.
    """
    size = _mini_batch_size(batch_size, num_mini_batches, dp_size)
    return [i for m in range(num_mini_batches) for i in range(m * size + dp_rank, (m + 1) * size, dp_size)]


def split_batch(lengths: list[int], num_mini_batches: int, layout: DataLayout) -> list[RankSplit]:
    """Every data-parallel rank's rows and micro-batches (see the module docstring).

    Args:
        lengths: [B] prompt + response tokens of each row of the batch.
        num_mini_batches: optimizer steps of the step.
        layout: the micro-batch rule (`dp_rank` is ignored: all ranks are planned).

    Returns:
        One `RankSplit` per data-parallel rank; all have the same number of micro-batches in
        each mini-batch.

    Raises:
        ValueError: the rows do not split into mini-batches x ranks, or a row exceeds the budget.
    """
    d, budget = layout.dp_size, layout.max_tokens_per_micro_batch
    if not budget:
        by_rank = [dp_rows(len(lengths), num_mini_batches, r, d) for r in range(d)]
        n = len(by_rank[0]) // num_mini_batches
        return [
            [_chunks(rows[m * n : (m + 1) * n], layout.micro_batch_size) for m in range(num_mini_batches)]
            for rows in by_rank
        ]
    size = _mini_batch_size(len(lengths), num_mini_batches, d)
    splits: list[RankSplit] = [[] for _ in range(d)]
    for m in range(num_mini_batches):
        first = m * size
        per_rank = split_by_tokens(lengths[first : first + size], d, budget, layout.cost)
        for r in range(d):
            splits[r].append([[first + i for i in micro] for micro in per_rank[r]])
    return splits


def flatten(split: RankSplit) -> tuple[list[int], list[list[int]]]:
    """A rank's rows in training order, and per mini-batch the rows of each of its micro-batches."""
    rows = [i for micro_batches in split for micro in micro_batches for i in micro]
    return rows, [[len(micro) for micro in micro_batches] for micro_batches in split]


def _chunks(rows: list[int], micro_batch_size: int) -> list[list[int]]:
    step = micro_batch_size or len(rows)
    return [rows[i : i + step] for i in range(0, len(rows), step)]


def split_by_tokens(
    lengths: list[int], dp_size: int, budget: int, cost: Callable[[list[int]], int]
) -> list[list[list[int]]]:
    """One mini-batch cut into micro-batches of at most `budget` and dealt to the ranks.

    Args:
        lengths: [n] prompt + response tokens of the mini-batch's rows (n a multiple of dp_size).
        dp_size: data-parallel ranks D.
        budget: most positions a micro-batch may occupy.
        cost: positions the packing gives rows of these lengths (`DataLayout.cost`).

    Returns:
        Per rank, its micro-batches (indices into `lengths`, ascending), the costliest first so
        expert-parallel peers pad their i-th micro-batches to similar shapes; every rank has
        the same count.

    Raises:
        ValueError: a row alone exceeds the budget.
    """
    costs = [cost([n]) for n in lengths]
    for i, c in enumerate(costs):
        if c > budget:
            raise ValueError(
                f"a row of {lengths[i]} tokens (prompt + response; {c} positions packed) exceeds "
                f"trainer.max_tokens_per_micro_batch={budget}"
            )
    fewest = -(-sum(costs) // budget)
    parts = -(-fewest // dp_size) * dp_size
    while True:  # ends: with one row per micro-batch (parts = n) every one fits
        micro = balanced_partition(costs, parts)
        sizes = [cost([lengths[i] for i in rows]) for rows in micro]
        if max(sizes) <= budget:
            break
        parts += dp_size
    ranks = balanced_partition(sizes, dp_size, equal_size=True)
    return [[micro[j] for j in sorted(mine, key=lambda j: (-sizes[j], j))] for mine in ranks]
