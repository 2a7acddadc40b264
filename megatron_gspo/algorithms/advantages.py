"""Group-relative advantages shared by GRPO and GSPO: A_i = (r_i - mean_group) / (std_group + eps).

Std convention: the *sample* std (Bessel-corrected, ``torch.std(unbiased=True)``) everywhere
(group, batch, running and whitening), as TRL, verl and OpenRLHF do for GRPO, so advantages
and the hyper-parameters tuned on them (clip ranges, learning rates) carry over. For a group
of G rewards the normalised advantages therefore have sample variance 1 (population variance
(G-1)/G). It needs at least two values per statistic; a group_size of 1 is refused for
group normalisation.

A group whose rewards are all equal gets exactly A = 0 from group normalisation (not rounding
noise divided by eps), so it contributes no gradient; ``advantages/zero_adv_group_frac`` counts
groups whose final advantages are all zero. ROLL's whitening subtracts the batch's token mean,
which moves such groups off zero (as in ROLL).

The option names and their order follow ROLL (alibaba/ROLL ``reward_postprocess`` and
``compute_advantage``); "ROLL's keys" in docs/algorithms.md maps each to this project's config.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_gspo.algorithms.running_stats import RunningMeanStd

REWARD_NORMS: tuple[str, ...] = ("group", "batch", "running", "none")
_WHITEN_EPS = 1e-8  # ROLL's masked_whiten: rsqrt(var + 1e-8)


def _check_number(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return float(value)


def compute_group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    eps: float = 1e-6,
    reward_clip: float | None = None,
    reward_norm: str = "group",
    reward_shift: bool = False,
    reward_scale: bool = False,
    whiten_advantages: bool = False,
    advantage_clip: float | None = None,
    running_stats: RunningMeanStd | None = None,
    response_lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Turns scalar rewards into one advantage per response, in ROLL's order and meaning.

    Steps, in order (ROLL's ``reward_postprocess`` then ``compute_advantage`` with the
    ``reinforce`` / ``grpo`` estimators, gamma 1, no token-level reward):

    1. normalise (``reward_norm``): ``group`` = (r - group mean) / (group std + eps), ``batch``
       = the same over the whole batch, ``running`` = (r - running mean) / (running std + eps)
       after adding this batch to ``running_stats``, ``none`` = r unchanged. ``reward_shift``
       only subtracts the mean, ``reward_scale`` only divides by the std (ROLL's booleans);
    2. clip the normalised rewards to [-reward_clip, reward_clip] (ROLL clips after normalising);
    3. whiten (``whiten_advantages``) as ROLL's ``masked_whiten`` over the batch's response
       tokens: every response's advantage counts once per token (``response_lengths``; one
       token each when not given), A = (A - token mean) / sqrt(token sample variance + 1e-8);
    4. clip to [-advantage_clip, advantage_clip].

    Args:
        rewards: [B] rewards, B = number of groups * group_size, consecutive rows one group.
        group_size: G, responses per prompt.
        eps: added to every std of step 1 before dividing.
        reward_clip: symmetric clip of the normalised rewards, or None.
        reward_norm: ``group`` (GRPO/GSPO), ``batch``, ``running`` or ``none``.
        reward_shift: normalise by subtracting the mean only (not with ``none``).
        reward_scale: normalise by dividing by the std only (not with ``none``).
        whiten_advantages: token-weighted batch whitening after normalisation.
        advantage_clip: symmetric advantage clip, or None.
        running_stats: state for ``reward_norm="running"`` (updated in place); only then.
        response_lengths: [B] response tokens of each row, the whitening weights.

    Returns:
        (advantages [B] float32, metrics): ``advantages/zero_adv_group_frac``,
        ``advantages/mean|std|min|max``, ``rewards/mean|std`` (of the raw rewards),
        ``advantages/clipfrac`` (if ``advantage_clip``), ``rewards/clipfrac`` (if
        ``reward_clip``), all detached 0-dim tensors.

    Raises:
        ValueError: bad shapes, non-finite rewards, or inconsistent options (the message says why).
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1 or rewards.numel() == 0:
        shape = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a non-empty 1-D tensor [B], got {shape}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if reward_norm not in REWARD_NORMS:
        raise ValueError(f"unknown reward_norm {reward_norm!r}; valid: {', '.join(REWARD_NORMS)}")
    eps = _check_number("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if reward_clip is not None:
        reward_clip = _check_number("reward_clip", reward_clip, positive=True)
    if advantage_clip is not None:
        advantage_clip = _check_number("advantage_clip", advantage_clip, positive=True)
    for name, value in (("reward_shift", reward_shift), ("reward_scale", reward_scale)):
        if not isinstance(value, bool):
            raise ValueError(
                f"{name} must be a bool (ROLL's: normalise by the mean only / the std only), got {value!r}"
            )
    if reward_shift and reward_scale:
        raise ValueError(
            "reward_shift and reward_scale together: one subtracts the mean only, the other divides "
            "by the std only; set one"
        )
    if reward_norm == "none" and (reward_shift or reward_scale):
        raise ValueError(
            "reward_shift / reward_scale choose how reward_norm normalises; with reward_norm='none' "
            "there is nothing to shift or scale"
        )
    if reward_norm == "group" and group_size < 2:
        raise ValueError("reward_norm='group' needs group_size >= 2 (a sample std needs two rewards)")
    if (reward_norm == "batch" or whiten_advantages) and rewards.numel() < 2:
        raise ValueError("batch normalisation / whitening needs at least 2 rewards")
    if (reward_norm == "running") != (running_stats is not None):
        raise ValueError("running_stats is required with reward_norm='running' and only applies to it")
    if not isinstance(whiten_advantages, bool):
        raise ValueError(f"whiten_advantages must be a bool, got {whiten_advantages!r}")
    if response_lengths is not None and (
        response_lengths.shape != rewards.shape or bool((response_lengths < 1).any())
    ):
        raise ValueError(f"response_lengths must be [B] = {tuple(rewards.shape)} positive counts")
    if not bool(torch.isfinite(rewards).all()):
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        raise ValueError(f"rewards are NaN or inf at index(es) {bad[:8]}")

    # float64 so that equal rewards give an exactly zero centred value.
    raw = r = rewards.detach().to(torch.float64)
    groups = r.view(-1, group_size)
    centre, divide = not reward_scale, not reward_shift
    if reward_norm == "group":
        constant_group = (groups.amax(dim=-1) == groups.amin(dim=-1)).unsqueeze(-1)
        adv = groups - groups.mean(dim=-1, keepdim=True) if centre else groups
        adv = torch.where(constant_group & centre, 0.0, adv)
        adv = (adv / (groups.std(dim=-1, keepdim=True) + eps) if divide else adv).flatten()
    elif reward_norm == "batch":
        adv = r - r.mean() if centre else r
        adv = adv / (r.std() + eps) if divide else adv
    elif reward_norm == "running":
        running_stats.update(r)
        adv = r - running_stats.mean if centre else r
        adv = adv / (running_stats.std + eps) if divide else adv
    else:
        adv = r

    metrics: dict[str, Tensor] = {}
    if reward_clip is not None:
        metrics["rewards/clipfrac"] = (adv.abs() > reward_clip).float().mean()
        adv = adv.clamp(-reward_clip, reward_clip)
    if whiten_advantages:
        weights = torch.ones_like(adv) if response_lengths is None else response_lengths.to(adv)
        tokens = weights.sum()
        mean = (weights * adv).sum() / tokens
        var = (weights * (adv - mean).square()).sum() / (tokens - 1)
        adv = (adv - mean) * torch.rsqrt(var + _WHITEN_EPS)
    if advantage_clip is not None:
        metrics["advantages/clipfrac"] = (adv.abs() > advantage_clip).float().mean()
        adv = adv.clamp(-advantage_clip, advantage_clip)

    zero_groups = (adv.view(-1, group_size) == 0).all(dim=-1)
    metrics.update(
        {
            "advantages/zero_adv_group_frac": zero_groups.float().mean(),
            "advantages/mean": adv.mean().float(),
            "advantages/std": (adv.std() if adv.numel() > 1 else torch.zeros(())).float(),
            "advantages/min": adv.min().float(),
            "advantages/max": adv.max().float(),
            "rewards/mean": raw.mean().float(),
            "rewards/std": (raw.std() if raw.numel() > 1 else torch.zeros(())).float(),
        }
    )
    return adv.to(torch.float32), metrics
