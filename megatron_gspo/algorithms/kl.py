"""KL penalty to a reference policy (the ``use_kl_loss`` option), per token and aggregated.

Estimators of KL(pi_theta || pi_ref) from tokens sampled by the policy (Schulman, "Approximating
KL divergence", 2020), with ``d = log pi_theta - log pi_ref``:

- ``k1``: ``d`` (unbiased, high variance, can be negative),
- ``k2``: ``d^2 / 2`` (biased, low variance),
- ``k3``: ``exp(-d) - 1 + d`` (unbiased, low variance, always >= 0); ``low_var_kl`` is verl's and
  ROLL's name for it. As both compute it, ``d`` is clamped to [-20, 20] before the exponential and
  the estimate to at most 10 (verl ``kl_penalty("low_var_kl")``, ROLL ``compute_approx_kl("k3")``):
  past the clamp a token's KL term has no gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_gspo.algorithms.aggregation import aggregate_token_losses, check_loss_agg_mode, local_normalizer
from megatron_gspo.algorithms.inputs import validate_token_inputs, zero_masked

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")
_ALIASES = {"low_var_kl": "k3"}
# exp(20) ~ 4.9e8 stays finite in fp32 and bf16; k3's exponential needs the bound.
_K3_LOG_RATIO_BOUND = 20.0
# verl and ROLL clamp the k3 estimate itself to [-10, 10] (it is >= 0, so only the top acts).
_K3_VALUE_BOUND = 10.0


def canonical_estimator(estimator: str) -> str:
    """``k1``, ``k2`` or ``k3`` for any accepted name (``low_var_kl`` is k3).

    Raises:
        ValueError: unknown estimator.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    return _ALIASES.get(estimator, estimator)


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL estimate between the policy and the reference.

    Args:
        log_probs: [B, T] log pi_theta (differentiable).
        ref_log_probs: [B, T] log pi_ref (treated as constant).
        estimator: ``k1``, ``k2``, ``k3`` or ``low_var_kl`` (= k3: ``d`` clamped to [-20, 20]
            before exp, the estimate to at most 10).

    Returns:
        [B, T] per-token estimates (no masking: see :func:`compute_kl_loss`).

    Raises:
        ValueError: unknown estimator or mismatched shapes.
    """
    estimator = canonical_estimator(estimator)
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} "
            "differ in shape"
        )
    log_ratio = log_probs - ref_log_probs.detach()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    log_ratio = log_ratio.clamp(-_K3_LOG_RATIO_BOUND, _K3_LOG_RATIO_BOUND)
    return (torch.expm1(-log_ratio) + log_ratio).clamp(max=_K3_VALUE_BOUND)


def compute_kl_loss(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    *,
    coef: float,
    loss_agg_mode: str,
    normalizer: float | Tensor | None = None,
    estimator: str = "k3",
) -> tuple[Tensor, dict[str, Tensor]]:
    """``coef`` times the aggregated per-token KL estimate; add it to the policy loss.

    Use the same ``loss_agg_mode`` and global ``normalizer`` as the policy loss so that the
    sum stays invariant to how the mini-batch is split.

    Args:
        log_probs: [B, T] log pi_theta (differentiable).
        ref_log_probs: [B, T] log pi_ref.
        response_mask: [B, T] bool or 0/1; values elsewhere are ignored even if NaN/inf.
        coef: KL loss coefficient (``kl_loss_coef``, e.g. 0.001), finite and >= 0.
        loss_agg_mode: see :mod:`megatron_gspo.algorithms.aggregation`.
        normalizer: global normaliser from ``compute_loss_normalizer``; None uses the local batch.
        estimator: ``k1``, ``k2``, ``k3`` or ``low_var_kl``.

    Returns:
        (loss, metrics) with ``actor/kl_ref`` (mean per-token estimate) and ``actor/kl_loss``.

    Raises:
        ValueError: bad coef, mode or estimator.
        PolicyLossInputError: malformed tensors.
    """
    if isinstance(coef, bool) or not isinstance(coef, int | float) or not math.isfinite(coef) or coef < 0:
        raise ValueError(f"coef must be a finite number >= 0, got {coef!r}")
    check_loss_agg_mode(loss_agg_mode)
    canonical_estimator(estimator)
    mask = validate_token_inputs(
        response_mask, {"log_probs": log_probs, "ref_log_probs": ref_log_probs}, normalizer=normalizer
    )
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    per_token = kl_penalty(
        zero_masked(log_probs.to(dtype), mask), zero_masked(ref_log_probs.to(dtype), mask), estimator
    )
    if normalizer is None:
        normalizer = local_normalizer(mask, loss_agg_mode)
    loss = coef * aggregate_token_losses(per_token, mask, loss_agg_mode, normalizer)
    with torch.no_grad():
        kl_mean = zero_masked(per_token, mask).sum() / mask.sum()
    return loss, {"actor/kl_ref": kl_mean.float(), "actor/kl_loss": loss.detach().float()}
