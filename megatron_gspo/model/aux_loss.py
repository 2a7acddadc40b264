"""Weight megatron's MoE load-balancing loss like the policy loss.

Megatron adds the aux loss inside the router: `MoEAuxLossAutoScaler` injects
`coeff * aux_mb` into the backward of each micro-batch, multiplied by a class-level scale
that megatron's own schedule sets to `1 / num_microbatches` (then DDP averages over DP).
Here the policy loss of micro-batch `mb` is `sum_mb / N` (N: the mini-batch's normaliser
summed over DP) times `dp_size`, so that DDP's average gives the full-batch loss. The aux
loss gets the same weight: scale_mb = dp_size * n_mb / N, where n_mb is the micro-batch's
share of N. Summed over micro-batches and averaged over DP, the aux term is then the
normaliser-weighted mean of the micro-batches' aux losses, with weights summing to 1, however
the mini-batch is split.
"""

from __future__ import annotations

import torch

from megatron_gspo.model.micro_batch_hooks import MicroBatchHooks


def aux_loss_scale(micro_normalizer: torch.Tensor, normalizer: torch.Tensor, dp_size: int) -> torch.Tensor:
    """The backward scale of one micro-batch's aux loss.

    Args:
        micro_normalizer: [] this micro-batch's share of the loss normaliser (tokens or sequences).
        normalizer: [] the mini-batch's normaliser, summed over data-parallel ranks.
        dp_size: data-parallel ranks (DDP averages gradients over them).

    Returns:
        [] float32 scale on the device of `normalizer`.
    """
    return (micro_normalizer.double() * dp_size / normalizer.double()).float()


def set_aux_loss_scale(scale: torch.Tensor) -> None:
    """Make megatron scale the aux-loss gradient of the next backward by `scale` ([] float32)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # set_loss_scale keeps the first tensor it gets and copies into it afterwards: hand it its own,
    # shaped [1] like the one megatron's schedules set (a [] one would refuse their later copies).
    MoEAuxLossAutoScaler.set_loss_scale(scale.detach().to(torch.float32).reshape(1).clone())


class AuxLossWeights(MicroBatchHooks):
    """Set micro-batch i's aux-loss scale right before its backward (a schedule hook).

    Megatron's scale is one class-level value read during backward, and its schedule resets
    it to 1 / num_microbatches after every forward; under a pipeline several forwards run
    before a backward. Setting it when micro-batch i's backward starts gives each backward
    (and its recompute) its own weight.

    Args:
        scales: per micro-batch of the run, from `aux_loss_scale`.
    """

    def __init__(self, scales: list[torch.Tensor]) -> None:
        self.scales = scales

    def before_backward(self, i: int) -> None:
        """Weight micro-batch i's aux-loss gradient."""
        set_aux_loss_scale(self.scales[i])


class FillerAuxScale:
    """The aux-loss scale of a padded run: megatron's for the real count, zero for fillers."""

    def __init__(self, real: int, config) -> None:
        from megatron_gspo.model.context_parallel import context_parallel_state

        self.scale = context_parallel_state()[0] / real  # megatron's: loss scale (1) x CP / count
        self.per_token = config.calculate_per_token_loss

    def real(self) -> MicroBatchHooks:
        """The hook of a real micro-batch (runs before the caller's)."""
        return _SetAuxScale(1.0 if self.per_token else self.scale)

    def filler(self) -> MicroBatchHooks:
        """The hook of a filler (runs after the caller's)."""
        return _SetAuxScale(0.0)


class _SetAuxScale(MicroBatchHooks):
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def before_backward(self, i: int) -> None:
        from megatron_gspo.model.distributed import compute_device

        set_aux_loss_scale(torch.tensor(self.scale, device=compute_device()))
