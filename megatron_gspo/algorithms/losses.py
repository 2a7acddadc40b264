"""The registered policy losses: ``gspo``, ``gspo_token``, ``grpo``, ``sapo``.

Each returns the *loss to minimise*, i.e. the negated per-token objective. Ratio level
(token / sequence), clipping (hard clip / soft gate) and aggregation are separate choices:
these functions fix the first two, ``loss_agg_mode`` the third.

Every loss clamps log-ratios to [-log_ratio_clamp, log_ratio_clamp] before exponentiating so
that one wild token cannot overflow (exp(20) ~ 4.9e8 is finite in fp32 and bf16); beyond the
clamp the gradient through that log-ratio is zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_gspo.algorithms.inputs import zero_masked
from megatron_gspo.algorithms.registry import (
    PolicyLossInputs,
    PolicyLossTerms,
    check_fraction,
    check_positive,
    no_clip,
    register_policy_loss,
)


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's pessimistic clipped surrogate, negated: max(-r A, -clip(r, 1-eps_low, 1+eps_high) A).

    Args:
        ratio: importance ratios, any shape.
        advantages: advantages of the same shape.
        clip_low: eps_low.
        clip_high: eps_high.

    Returns:
        (loss, clipped_low, clipped_high), all of ``ratio``'s shape. ``clipped_low`` is
        A < 0 and r < 1 - eps_low, ``clipped_high`` is A > 0 and r > 1 + eps_high: exactly the
        entries where the clipped branch wins and the gradient is zero.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clipped_low = (advantages < 0) & (ratio < 1.0 - clip_low)
        clipped_high = (advantages > 0) & (ratio > 1.0 + clip_high)
    return loss, clipped_low, clipped_high


def dual_clip(loss: Tensor, advantages: Tensor, clip_ratio_c: float | None) -> tuple[Tensor, Tensor | None]:
    """Dual clip (Ye et al., arXiv 1912.09729): for A < 0 cap the loss at ``-clip_ratio_c A``.

    Args:
        loss: the clipped surrogate's loss, any shape.
        advantages: advantages of the same shape.
        clip_ratio_c: c > 1, or None (no dual clip).

    Returns:
        (loss, capped): ``capped`` marks where the cap won (None without dual clip).
    """
    if clip_ratio_c is None:
        return loss, None
    clip_ratio_c = check_positive("clip_ratio_c", clip_ratio_c, above=1.0)
    bound = -advantages * clip_ratio_c
    negative = advantages < 0
    with torch.no_grad():
        capped = negative & (loss > bound)
    return torch.where(negative, torch.minimum(loss, bound), loss), capped


@register_policy_loss("gspo", sequence_ratio=True)
def gspo_loss(
    inputs: PolicyLossInputs,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    clip_ratio_c: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> PolicyLossTerms:
    """GSPO, Group Sequence Policy Optimization (Zheng et al., arXiv 2507.18071).

    ``s_i = exp(1/|y_i| sum_t (log pi_theta - log pi_old))`` and per response
    ``loss_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)``, repeated on each of
    its tokens (so ``seq-mean-token-mean`` gives the paper's ``1/G sum_i loss_i``). A clip drops a
    whole response. Needs one advantage per response, [B].

    Args:
        inputs: validated inputs; ``sequence_advantages`` must be set.
        clip_low: eps_low (paper: 3e-4).
        clip_high: eps_high (paper: 4e-4).
        clip_ratio_c: dual-clip bound c > 1 on each response's loss for A < 0 (ROLL's
            ``dual_clip_loss``: 1.4), or None.
        log_ratio_clamp: bound on the sequence log-ratio before exp.

    Returns:
        Terms with [B] sequence ratios; ``actor/clipfrac_dual_tokens`` when dual clip is on.
    """
    clip_low = check_fraction("clip_low", clip_low, upper_open=1.0)
    clip_high = check_fraction("clip_high", clip_high)
    log_ratio_clamp = check_positive("log_ratio_clamp", log_ratio_clamp)
    advantages = inputs.require_sequence_advantages("gspo")
    seq_ratio = torch.exp(inputs.sequence_log_ratio(log_ratio_clamp))
    seq_loss, low, high = clipped_surrogate(seq_ratio, advantages, clip_low, clip_high)
    seq_loss, dual = dual_clip(seq_loss, advantages, clip_ratio_c)
    mask = inputs.response_mask
    token_metrics = {}
    if dual is not None:
        high = high | dual
        token_metrics["actor/clipfrac_dual_tokens"] = dual.unsqueeze(-1) & mask
    return PolicyLossTerms(
        token_losses=zero_masked(seq_loss.unsqueeze(-1).expand_as(inputs.log_probs), mask),
        ratio=seq_ratio.detach(),
        clipped_low=low.unsqueeze(-1) & mask,
        clipped_high=high.unsqueeze(-1) & mask,
        token_metrics=token_metrics,
    )


@register_policy_loss("gspo_token", sequence_ratio=True)
def gspo_token_loss(
    inputs: PolicyLossInputs,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    clip_ratio_c: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> PolicyLossTerms:
    """GSPO-token (arXiv 2507.18071, section 4.3): GSPO's ratio with per-token advantages.

    ``s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]`` (value s_i, gradient
    ``s_i grad log pi_theta(y_it)``) and ``loss_it = -min(s_it A_it, clip(s_it) A_it)``. With
    ``A_it = A_i`` for all t it equals GSPO in value, clip decisions and gradient.

    Args:
        inputs: validated inputs; advantages [B] or [B, T].
        clip_low: eps_low (paper: 3e-4).
        clip_high: eps_high (paper: 4e-4).
        clip_ratio_c: dual-clip bound c > 1 for A < 0, or None.
        log_ratio_clamp: bound on the (detached) sequence log-ratio before exp.

    Returns:
        Terms with [B] sequence ratios; ``actor/clipfrac_dual_tokens`` when dual clip is on.
    """
    clip_low = check_fraction("clip_low", clip_low, upper_open=1.0)
    clip_high = check_fraction("clip_high", clip_high)
    log_ratio_clamp = check_positive("log_ratio_clamp", log_ratio_clamp)
    seq_log_ratio = inputs.sequence_log_ratio(log_ratio_clamp).detach()
    log_probs = inputs.log_probs
    token_ratio = torch.exp(seq_log_ratio.unsqueeze(-1) + log_probs - log_probs.detach())
    advantages = inputs.advantages
    advantages = advantages.unsqueeze(-1).expand_as(token_ratio) if advantages.dim() == 1 else advantages
    token_loss, low, high = clipped_surrogate(token_ratio, advantages, clip_low, clip_high)
    token_loss, dual = dual_clip(token_loss, advantages, clip_ratio_c)
    mask = inputs.response_mask
    token_metrics = {}
    if dual is not None:
        high = high | dual
        token_metrics["actor/clipfrac_dual_tokens"] = dual & mask
    return PolicyLossTerms(
        token_losses=zero_masked(token_loss, mask),
        ratio=torch.exp(seq_log_ratio),
        clipped_low=low & mask,
        clipped_high=high & mask,
        token_metrics=token_metrics,
    )


@register_policy_loss("grpo")
def grpo_loss(
    inputs: PolicyLossInputs,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.27,
    clip_ratio_c: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> PolicyLossTerms:
    """GRPO's token-level clipped surrogate (Shao et al., arXiv 2402.03300), with clip-higher.

    ``w_it = pi_theta(y_it) / pi_old(y_it)``,
    ``loss_it = -min(w_it A_it, clip(w_it, 1 - clip_low, 1 + clip_high) A_it)``. With dual clip
    (Ye et al., arXiv 1912.09729) and A < 0 the loss is additionally capped at ``-clip_ratio_c A``,
    so a token with a huge ratio stops pushing (counted as clipped high).

    Args:
        inputs: validated inputs; advantages [B] or [B, T].
        clip_low: eps_low (GSPO paper's GRPO baseline: 0.2).
        clip_high: eps_high (0.27).
        clip_ratio_c: dual-clip bound c > 1 (e.g. 3.0), or None for no dual clip.
        log_ratio_clamp: bound on each token's log-ratio before exp.

    Returns:
        Terms with [B, T] token ratios; ``actor/clipfrac_dual_tokens`` when dual clip is on.
    """
    clip_low = check_fraction("clip_low", clip_low, upper_open=1.0)
    clip_high = check_fraction("clip_high", clip_high)
    log_ratio_clamp = check_positive("log_ratio_clamp", log_ratio_clamp)
    ratio = torch.exp(inputs.token_log_ratio(log_ratio_clamp))
    advantages = inputs.advantages
    loss, low, high = clipped_surrogate(ratio, advantages, clip_low, clip_high)
    loss, dual = dual_clip(loss, advantages, clip_ratio_c)
    token_metrics = {}
    if dual is not None:
        high = high | dual
        token_metrics["actor/clipfrac_dual_tokens"] = dual
    mask = inputs.response_mask
    return PolicyLossTerms(
        token_losses=zero_masked(loss, mask),
        ratio=ratio.detach(),
        clipped_low=low & mask,
        clipped_high=high & mask,
        token_metrics=token_metrics,
    )


@register_policy_loss("sapo")
def sapo_loss(
    inputs: PolicyLossInputs,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    log_ratio_clamp: float = 20.0,
) -> PolicyLossTerms:
    """SAPO, soft adaptive policy optimisation (Qwen, arXiv 2511.20347): a soft gate, no hard clip.

    ``f(r) = sigmoid(tau (r - 1)) * 4 / tau`` with ``tau = tau_pos`` if A > 0 else ``tau_neg``;
    ``loss_it = -f(r_it) A_it``. The gradient weight ``4 p (1 - p)``, ``p = sigmoid(tau (r - 1))``,
    is 1 on-policy and decays smoothly off-policy (faster for negative advantages).

    Args:
        inputs: validated inputs; advantages [B] or [B, T].
        tau_pos: temperature for A > 0 (paper: 1.0).
        tau_neg: temperature for A <= 0 (paper: 1.05).
        log_ratio_clamp: bound on each token's log-ratio before exp (e.g. 20).

    Returns:
        Terms with [B, T] token ratios, no clipping, and ``actor/sapo_gate_weight`` (the
        gradient weight 4 p (1 - p)).
    """
    tau_pos = check_positive("tau_pos", tau_pos)
    tau_neg = check_positive("tau_neg", tau_neg)
    log_ratio_clamp = check_positive("log_ratio_clamp", log_ratio_clamp)
    ratio = torch.exp(inputs.token_log_ratio(log_ratio_clamp))
    advantages = inputs.advantages
    tau = torch.full_like(ratio, tau_neg).masked_fill(advantages > 0, tau_pos)
    gate_prob = torch.sigmoid(tau * (ratio - 1.0))
    loss = -gate_prob * (4.0 / tau) * advantages
    mask = inputs.response_mask
    return PolicyLossTerms(
        token_losses=zero_masked(loss, mask),
        ratio=ratio.detach(),
        clipped_low=no_clip(mask),
        clipped_high=no_clip(mask),
        token_metrics={"actor/sapo_gate_weight": (4.0 * gate_prob * (1.0 - gate_prob)).detach()},
    )
