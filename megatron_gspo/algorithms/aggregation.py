"""Loss aggregation over a [B, T] matrix of per-token losses, normalised over the global batch.

Modes (ROLL's names); ``l_it`` is the loss of token t of response i, ``|y_i|`` its length,
``B`` the number of responses and ``N`` the normaliser:

- ``token-mean``: ``sum_i sum_t l_it / N``, N = number of response tokens. Every token
  weighs the same, so a long response weighs ``|y_i|`` times more than a one-token one
  (DAPO's choice; favours long responses' tokens, no per-response length penalty).
- ``seq-mean-token-sum``: ``sum_i (sum_t l_it) / N``, N = number of responses. A response's
  weight grows with its length; the loss scale grows with the response length.
- ``seq-mean-token-mean``: ``sum_i (1/|y_i| sum_t l_it) / N``, N = number of responses.
  Every response weighs the same whatever its length, so each token of a short response
  weighs more (GRPO as published; GSPO's one term per response). Dr. GRPO points out the
  resulting length bias: a wrong answer is penalised less per token when it is long.
- ``seq-mean-token-sum-norm``: ``sum_i sum_t l_it / N``, N = number of responses times a
  constant length L (Dr. GRPO): no per-response length normalisation, a constant scale.

Why a global normaliser: a mini-batch is cut into micro-batches and spread over data-parallel
ranks. If every micro-batch divided by its own token or response count, the result (and the
gradient) would depend on how the batch was cut. So the trainer computes the normaliser once
for the whole mini-batch (:func:`compute_loss_normalizer` on each rank, then an all-reduce
with SUM across data-parallel ranks) and passes it to every micro-batch's loss; the
micro-batch losses of all ranks then *sum* to the loss of the unsplit mini-batch. (If the
data-parallel gradient reduction averages instead of summing, scale the loss by the
data-parallel size.) Without a normaliser the local batch's own count is used, which is only
exact when the batch is not split.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_gspo.algorithms.inputs import check_response_mask_shape, validate_token_inputs, zero_masked

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# Modes whose per-response term is a plain token sum (no 1/|y_i|): GSPO refuses them.
TOKEN_SUM_AGG_MODES: frozenset[str] = frozenset({"seq-mean-token-sum", "seq-mean-token-sum-norm"})


def check_loss_agg_mode(loss_agg_mode: str) -> None:
    """Raises ValueError listing the valid modes if ``loss_agg_mode`` is not one of them.

    Args:
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")


def compute_loss_normalizer(
    response_mask: Tensor, loss_agg_mode: str, *, max_response_length: int | None = None
) -> Tensor:
    """Computes this rank's share of the loss normaliser for one mini-batch.

    Sum the result over data-parallel ranks (``all_reduce(SUM)``) and pass it as
    ``normalizer`` to the loss of every micro-batch of that mini-batch.

    Args:
        response_mask: [B, T] bool or 0/1 mask of this rank's whole mini-batch.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        max_response_length: the constant L of ``seq-mean-token-sum-norm`` (use the
            configured maximum generation length so it does not depend on padding). Defaults
            to T. Only valid with that mode.

    Returns:
        0-dim float64 tensor on the mask's device: the number of response tokens
        (``token-mean``), the number of responses (``seq-mean-*``), or the number of
        responses times L (``seq-mean-token-sum-norm``).

    Raises:
        ValueError: unknown mode, or ``max_response_length`` given for another mode or not positive.
        PolicyLossInputError: malformed mask (not 2-D, not binary, a response with no tokens).
    """
    check_loss_agg_mode(loss_agg_mode)
    if max_response_length is not None:
        if loss_agg_mode != "seq-mean-token-sum-norm":
            raise ValueError(
                f"max_response_length only applies to loss_agg_mode 'seq-mean-token-sum-norm', "
                f"not {loss_agg_mode!r}"
            )
        if isinstance(max_response_length, bool) or not isinstance(max_response_length, int):
            raise ValueError(f"max_response_length must be an int, got {max_response_length!r}")
        if max_response_length <= 0:
            raise ValueError(f"max_response_length must be > 0, got {max_response_length}")
    check_response_mask_shape(response_mask)
    mask = validate_token_inputs(response_mask, {})
    return local_normalizer(mask, loss_agg_mode, max_response_length=max_response_length)


def local_normalizer(mask: Tensor, loss_agg_mode: str, *, max_response_length: int | None = None) -> Tensor:
    """Normaliser of an already validated local batch (see :func:`compute_loss_normalizer`).

    Args:
        mask: [B, T] bool mask, validated.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        max_response_length: L for ``seq-mean-token-sum-norm``; defaults to T.

    Returns:
        0-dim float64 tensor.
    """
    num_responses = mask.shape[0]
    if loss_agg_mode == "token-mean":
        return mask.sum().to(torch.float64)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        length = max_response_length if max_response_length is not None else mask.shape[1]
        return torch.tensor(float(num_responses * length), dtype=torch.float64, device=mask.device)
    return torch.tensor(float(num_responses), dtype=torch.float64, device=mask.device)


def aggregate_token_losses(
    token_losses: Tensor, mask: Tensor, loss_agg_mode: str, normalizer: float | Tensor
) -> Tensor:
    """Reduces per-token losses to one scalar (inputs assumed validated).

    Args:
        token_losses: [B, T] per-token loss; values at masked-out positions are ignored.
        mask: [B, T] bool mask with at least one token per row.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        normalizer: N of the module docstring (global for a split mini-batch).

    Returns:
        0-dim tensor, differentiable w.r.t. ``token_losses``.
    """
    token_losses = zero_masked(token_losses, mask)
    if loss_agg_mode == "seq-mean-token-mean":
        lengths = mask.sum(dim=-1).to(token_losses.dtype)
        total = (token_losses.sum(dim=-1) / lengths).sum()
    else:
        total = token_losses.sum()
    if isinstance(normalizer, Tensor):
        normalizer = normalizer.to(device=total.device, dtype=total.dtype)
    return total / normalizer


def aggregate_loss(
    token_losses: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    normalizer: float | Tensor | None = None,
) -> Tensor:
    """Validates its inputs, then reduces per-token losses to one scalar.

    Args:
        token_losses: [B, T] per-token loss (NaN/inf allowed only at masked-out positions).
        response_mask: [B, T] bool or 0/1 mask.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        normalizer: global normaliser from :func:`compute_loss_normalizer` (all-reduced);
            None uses the local batch's own.

    Returns:
        0-dim tensor.
    """
    check_loss_agg_mode(loss_agg_mode)
    mask = validate_token_inputs(response_mask, {"token_losses": token_losses}, normalizer=normalizer)
    if normalizer is None:
        normalizer = local_normalizer(mask, loss_agg_mode)
    return aggregate_token_losses(token_losses, mask, loss_agg_mode, normalizer)
