"""compute_policy_loss: validate, look the loss up in the registry, aggregate, report metrics.

Metrics leave as detached tensors (no host synchronisation) under ``actor/`` keys; they are
statistics of the local micro-batch, to be averaged once per step by the trainer:

- ``actor/pg_loss``: the aggregated loss.
- ``actor/clipfrac_tokens`` (``_low`` / ``_high``): fraction of response tokens whose clip is
  active (gradient zeroed) below / above the trust region; GSPO counts every token of a
  clipped response.
- ``actor/clipfrac_seq`` (``_low`` / ``_high``): fraction of responses with at least one
  clipped token (for GSPO: clipped responses).
- ``actor/ratio_mean`` / ``_min`` / ``_max``: the ratio the loss acts on, over responses for
  sequence-level losses (GSPO's s_i) and over response tokens for token-level ones.
- ``actor/log_ratio_std``: population std of the per-token log pi_theta - log pi_old.
- ``actor/approx_kl``: k3 estimate of KL(pi_old || pi_theta), mean over response tokens.
- ``actor/masked_out_frac``: fraction of the [B, T] positions outside ``response_mask``.
- loss-specific ones (e.g. ``actor/clipfrac_dual_tokens``, ``actor/sapo_gate_weight``).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Importing the module registers the built-in losses.
from megatron_gspo.algorithms import losses as _builtin_losses  # noqa: F401
from megatron_gspo.algorithms.aggregation import (
    TOKEN_SUM_AGG_MODES,
    aggregate_token_losses,
    check_loss_agg_mode,
    local_normalizer,
)
from megatron_gspo.algorithms.inputs import validate_token_inputs, zero_masked
from megatron_gspo.algorithms.registry import POLICY_LOSSES, PolicyLossInputs, PolicyLossTerms


def compute_policy_loss(
    loss_type: str,
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str | None = None,
    normalizer: float | Tensor | None = None,
    allow_token_sum_for_gspo: bool = False,
    token_weights: Tensor | None = None,
    **options,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Computes a registered policy loss over a (micro-)batch of responses.

    Args:
        loss_type: a registered name: ``gspo``, ``gspo_token``, ``grpo``, ``sapo`` or one
            added with ``register_policy_loss``.
        log_probs: [B, T] log pi_theta of the sampled tokens (differentiable).
        old_log_probs: [B, T] log pi_old (e.g. the rollout engine's); treated as constant.
        advantages: [B] (one per response) or [B, T] (per token); treated as constant.
        response_mask: [B, T] bool or 0/1; values elsewhere are ignored even if NaN/inf.
        loss_agg_mode: see :mod:`megatron_gspo.algorithms.aggregation`; None picks the loss's
            default (``seq-mean-token-mean`` for all built-in losses).
        normalizer: the mini-batch's global normaliser from ``compute_loss_normalizer``
            (all-reduced over data-parallel ranks); None uses this batch's own.
        allow_token_sum_for_gspo: let a sequence-ratio loss (gspo, gspo_token) use a token-sum
            mode. Only valid for those losses.
        token_weights: [B, T] constant multipliers of the per-token loss before aggregation
            (the rollout correction's weights, :mod:`megatron_gspo.algorithms.rollout_correction`);
            None: all 1. Metrics other than ``actor/pg_loss`` do not depend on them.
        **options: the loss's own options (e.g. ``clip_low``); any other name is an error.

    Returns:
        (loss, metrics): 0-dim loss to minimise, and detached 0-dim metric tensors.

    Raises:
        ValueError: unknown loss type, mode or option; an option that does not apply; a
            token-sum mode for GSPO without ``allow_token_sum_for_gspo``.
        PolicyLossInputError: malformed tensors (shapes, NaN/inf at response tokens, empty
            responses, non-positive normaliser).
    """
    spec = POLICY_LOSSES.get(loss_type)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        valid = ", ".join(spec.options) or "none"
        raise ValueError(
            f"option(s) {unknown} do not apply to policy loss {loss_type!r}; its options: {valid}"
        )
    mode = spec.default_agg_mode if loss_agg_mode is None else loss_agg_mode
    check_loss_agg_mode(mode)
    if allow_token_sum_for_gspo and not spec.sequence_ratio:
        raise ValueError(
            f"allow_token_sum_for_gspo only applies to sequence-ratio losses (gspo, gspo_token), "
            f"not {loss_type!r}"
        )
    if spec.sequence_ratio and mode in TOKEN_SUM_AGG_MODES and not allow_token_sum_for_gspo:
        raise ValueError(
            f"{loss_type!r} with loss_agg_mode {mode!r} sums one sequence-level term per token, so each "
            "response is weighted by its length, which GSPO's length-normalised ratio is meant to avoid; "
            "use 'seq-mean-token-mean' (as published) or pass allow_token_sum_for_gspo=True to force it"
        )

    inputs = build_policy_loss_inputs(
        log_probs, old_log_probs, advantages, response_mask, normalizer, token_weights=token_weights
    )
    terms = spec.fn(inputs, **options)
    if normalizer is None:
        normalizer = local_normalizer(inputs.response_mask, mode)
    token_losses = terms.token_losses
    if token_weights is not None:
        weights = zero_masked(token_weights.detach().to(token_losses.dtype), inputs.response_mask)
        token_losses = token_losses * weights
    loss = aggregate_token_losses(token_losses, inputs.response_mask, mode, normalizer)
    metrics = policy_loss_metrics(inputs, terms)
    metrics["actor/pg_loss"] = loss.detach()
    return loss, metrics


def build_policy_loss_inputs(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    normalizer: float | Tensor | None = None,
    *,
    token_weights: Tensor | None = None,
) -> PolicyLossInputs:
    """Validates raw tensors (one host synchronisation) and packs them for a loss function.

    Computation happens in at least float32 (bf16 log-probs are upcast) so ratios are exact
    enough for GSPO's 3e-4 clip range.

    Args:
        log_probs: [B, T].
        old_log_probs: [B, T].
        advantages: [B] or [B, T].
        response_mask: [B, T].
        normalizer: optional, validated to be finite and > 0.
        token_weights: optional [B, T], validated to be finite at response tokens (applied by the caller).

    Returns:
        :class:`PolicyLossInputs` with zeros at masked-out positions.
    """
    tensors = {"log_probs": log_probs, "old_log_probs": old_log_probs}
    if token_weights is not None:
        tensors["token_weights"] = token_weights
    mask = validate_token_inputs(
        response_mask,
        tensors,
        advantages=advantages,
        normalizer=normalizer,
    )
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    log_probs = zero_masked(log_probs.to(dtype), mask)
    old_log_probs = zero_masked(old_log_probs.detach().to(dtype), mask)
    advantages = advantages.detach().to(dtype)
    sequence_advantages = advantages if advantages.dim() == 1 else None
    token_advantages = advantages.unsqueeze(-1).expand_as(log_probs) if advantages.dim() == 1 else advantages
    return PolicyLossInputs(
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=zero_masked(token_advantages, mask),
        sequence_advantages=sequence_advantages,
        response_mask=mask,
        lengths=mask.sum(dim=-1).to(dtype),
    )


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return zero_masked(values.to(torch.float32), mask).sum() / mask.sum()


@torch.no_grad()
def policy_loss_metrics(inputs: PolicyLossInputs, terms: PolicyLossTerms) -> dict[str, Tensor]:
    """Detached metrics of one loss evaluation (keys listed in the module docstring).

    Args:
        inputs: the validated inputs.
        terms: what the loss function returned.

    Returns:
        name -> 0-dim float32 tensor.
    """
    mask = inputs.response_mask
    low, high = terms.clipped_low & mask, terms.clipped_high & mask
    either = low | high
    metrics = {
        "actor/clipfrac_tokens": _masked_mean(either, mask),
        "actor/clipfrac_tokens_low": _masked_mean(low, mask),
        "actor/clipfrac_tokens_high": _masked_mean(high, mask),
        "actor/clipfrac_seq": either.any(dim=-1).float().mean(),
        "actor/clipfrac_seq_low": low.any(dim=-1).float().mean(),
        "actor/clipfrac_seq_high": high.any(dim=-1).float().mean(),
    }
    ratio = terms.ratio.float()
    if ratio.dim() == 1:
        metrics["actor/ratio_mean"] = ratio.mean()
        metrics["actor/ratio_min"] = ratio.min()
        metrics["actor/ratio_max"] = ratio.max()
    else:
        metrics["actor/ratio_mean"] = _masked_mean(ratio, mask)
        metrics["actor/ratio_min"] = torch.where(mask, ratio, torch.inf).min()
        metrics["actor/ratio_max"] = torch.where(mask, ratio, -torch.inf).max()
    log_ratio = inputs.token_log_ratio().float()
    mean_log_ratio = _masked_mean(log_ratio, mask)
    metrics["actor/log_ratio_std"] = _masked_mean((log_ratio - mean_log_ratio) ** 2, mask).sqrt()
    # k3 with r = pi_theta / pi_old estimates KL(pi_old || pi_theta) from pi_old's samples.
    clamped = inputs.token_log_ratio(clamp=20.0).float()
    metrics["actor/approx_kl"] = _masked_mean(torch.expm1(clamped) - clamped, mask)
    metrics["actor/masked_out_frac"] = 1.0 - mask.float().mean()
    for name, values in terms.token_metrics.items():
        metrics[name] = _masked_mean(values, mask)
    return metrics
