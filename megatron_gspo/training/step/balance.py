"""Splitting weighted items into parts of nearly equal total weight (pure Python).

Sorted greedy (longest processing time first): items in decreasing weight, each to the part
with the smallest total so far (then the fewest items). The heaviest part exceeds the optimum
by at most a third; without a size constraint the heaviest and lightest parts differ by at
most one item's weight (the heaviest was the lightest when it got its last item). Ties are
broken by index, so every caller gets the same answer.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def balanced_partition(weights: Sequence[int], parts: int, *, equal_size: bool = False) -> list[list[int]]:
    """Indices of `weights` split into `parts` non-empty parts of nearly equal total weight.

    Args:
        weights: one non-negative weight per item.
        parts: number of parts, 1 <= parts <= len(weights).
        equal_size: every part gets len(weights) / parts items (which must divide evenly).

    Returns:
        `parts` lists of item indices, each in increasing order.

    Raises:
        ValueError: `parts` out of range, or items that do not split evenly under `equal_size`.
    """
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} item(s) into {parts} non-empty part(s)")
    if equal_size and n % parts:
        raise ValueError(f"{n} items do not split into {parts} parts of equal size")
    capacity = n // parts if equal_size else n
    heap = [(0, 0, p) for p in range(parts)]  # (total weight, items, part): the lightest on top
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(n), key=lambda j: (-weights[j], j)):
        total, count, p = heapq.heappop(heap)
        out[p].append(i)
        if count + 1 < capacity:  # a full part leaves the heap
            heapq.heappush(heap, (total + weights[i], count + 1, p))
    return [sorted(part) for part in out]
