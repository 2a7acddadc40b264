"""The one micro-batch forward every pass goes through (pi_old recompute, training, SFT).

A `MicroBatch` is packed once per RL step and kept, so every pass over it (recompute, each
training pass) runs on identical rows; a hook that records or replays per-token state (e.g.
routing) can rely on that. Shapes: `B` samples of the micro-batch, `T` the longest of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gspo.model.logprobs import packed_forward
from megatron_gspo.model.packing import PackedBatch, pack_sequences, pad_to_shape, uniform_shape, unpack


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
    """

    indices: list[int]
    packed: PackedBatch
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor

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


def forward_microbatch(
    model: torch.nn.Module,
    packed: PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of a packed micro-batch, aligned with its samples' tokens.

    Args:
        model: the (DDP-wrapped) Megatron policy.
        packed: from `pack_uniform`.
        temperature: the sampling temperature (SGLang's log-probs are log_softmax(logits / T)).
        with_entropy: also return the per-token entropy (no gradient).

    Returns:
        (logprobs [B, T] with the autograd graph, entropy [B, T] or None); column 0 and
        positions past a sample's end are 0.
    """
    logprobs, entropy = packed_forward(model, packed, temperature=temperature, with_entropy=with_entropy)
    return unpack(logprobs, packed), None if entropy is None else unpack(entropy, packed)
