"""The micro-batch every pass runs (pi_old recompute, training), packed once per RL step.

A `MicroBatch` is packed once per RL step and kept, so every pass over it (recompute, each
training pass, all through `model/pipeline.py`'s schedule) runs on identical rows; a hook
that records or replays per-token state (e.g. routing) can rely on that. Shapes: `B` samples
of the micro-batch, `T` the longest of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gspo.model.packing import PackedBatch, pack_sequences, pad_to_shape, uniform_shape


@dataclass
class MicroBatch:
    """Samples of one forward/backward, with their per-token training data cut to `T`.

    Attributes:
        indices: [B] row indices of the samples in the step's rollout batch.
        packed: the packed rows (the same object for every pass of the step).
        response_mask: [B, T] bool, True on response tokens.
        old_logprobs: [B, T] log pi_old of the sampled tokens (rollout or recomputed), 0 elsewhere.
        rollout_logprobs: [B, T] the rollout engine's log-probs, 0 off the response.
        advantages: [B] one advantage per response.
        ref_logprobs: [B, T] log pi_ref of the sampled tokens, 0 elsewhere (KL loss only, else None).
    """

    indices: list[int]
    packed: PackedBatch
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens in the samples (prompt + response)."""
        return sum(length for _, _, length in self.packed.segments)


def pack_uniform(
    sequences: list[torch.Tensor], *, pad_multiple: int = 1, layout: str = "mask"
) -> PackedBatch:
    """Pack samples to a shape that is the same on all ranks exchanging MoE tokens (collective).

    `layout` is "mask" (local spec) or "thd" (TransformerEngine), see `packing_layout`.
    """
    packed = pack_sequences(sequences, layout=layout, pad_multiple=pad_multiple)
    return pad_to_shape(packed, *uniform_shape(packed))
