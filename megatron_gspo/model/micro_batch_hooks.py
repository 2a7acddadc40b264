"""Per-micro-batch callbacks of one schedule run (`pipeline.run_micro_batches`), keyed by index.

Routing replay, routing recording and the MoE aux-loss weights are hooks; see `pipeline` for
when each fires under 1F1B, activation recompute and the interleaved schedule.
"""

from __future__ import annotations

from collections.abc import Sequence


class MicroBatchHooks:
    """Per-micro-batch callbacks of one schedule run (override what you need).

    `i` is the micro-batch's index in the `batches` of `run_micro_batches`.
    """

    def before_forward(self, i: int) -> None:
        """Right before this stage's forward of micro-batch i (not called for recompute)."""

    def after_forward(self, i: int) -> None:
        """Right after this stage's forward of micro-batch i."""

    def before_backward(self, i: int) -> None:
        """Right before this stage's backward (and activation recompute) of micro-batch i."""


class PerChunkHooks(MicroBatchHooks):
    """Hooks given in `hooks` that differ per model chunk (a virtual pipeline).

    Chunk c's forwards and backwards fire `per_chunk[c]` only: state keyed by (chunk, micro-batch).

    Args:
        per_chunk: per chunk of the model, its hooks.
    """

    def __init__(self, per_chunk: Sequence[Sequence[MicroBatchHooks]]) -> None:
        self.per_chunk = per_chunk
