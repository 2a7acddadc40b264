"""Group-relative advantages shared by GRPO and GSPO: A_i = (r_i - mean_group) / (std_group + eps).

Std convention: the *sample* std (Bessel-corrected, ``torch.std(unbiased=True)``) everywhere
(group, batch, running and whitening), as TRL, verl and OpenRLHF do for GRPO, so advantages
and the hyper-parameters tuned on them (clip ranges, learning rates) carry over. For a group
of G rewards the normalised advantages therefore have sample variance 1 (population variance
(G-1)/G). It needs at least two values per statistic; a group_size of 1 is refused for
group normalisation.

A group whose rewards are all equal gets exactly A = 0 (not rounding noise divided by eps), so
it contributes no gradient; ``advantages/zero_adv_group_frac`` counts groups whose final
advantages are all zero.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_gspo.algorithms.running_stats import RunningMeanStd

REWARD_NORMS: tuple[str, ...] = ("group", "batch", "running", "none")


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
    reward_shift: float = 0.0,
    reward_scale: float = 1.0,
    whiten_advantages: bool = False,
    advantage_clip: float | None = None,
    running_stats: RunningMeanStd | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Turns scalar rewards into one advantage per response.

    Steps, in order: clip rewards to [-reward_clip, reward_clip]; normalise (``reward_norm``):
    ``group`` = (r - group mean) / (group std + eps), ``batch`` = the same over the whole
    batch, ``running`` = (r - running mean) / (running std + eps) after adding this batch to
    ``running_stats``, ``none`` = (r + reward_shift) * reward_scale; whiten over the batch
    ((A - mean) / (std + eps); after ``group`` the mean is 0 by construction and is not
    subtracted) if ``whiten_advantages``; clip to [-advantage_clip, advantage_clip].

    Args:
        rewards: [B] rewards, B = number of groups * group_size, consecutive rows one group.
        group_size: G, responses per prompt.
        eps: added to every std before dividing.
        reward_clip: symmetric reward clip before normalising, or None.
        reward_norm: ``group`` (GRPO/GSPO), ``batch``, ``running`` or ``none``.
        reward_shift: added to rewards, only with ``reward_norm="none"`` (normalisation would
            cancel it).
        reward_scale: multiplies rewards, only with ``reward_norm="none"``.
        whiten_advantages: batch-whiten the advantages after normalisation.
        advantage_clip: symmetric advantage clip, or None.
        running_stats: state for ``reward_norm="running"`` (updated in place); only then.

    Returns:
        (advantages [B] float32, metrics): ``advantages/zero_adv_group_frac``,
        ``advantages/mean|std|min|max``, ``rewards/mean|std`` (of the raw rewards),
        ``advantages/clipfrac`` (if ``advantage_clip``), all detached 0-dim tensors.

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
    reward_shift = _check_number("reward_shift", reward_shift)
    reward_scale = _check_number("reward_scale", reward_scale, positive=True)
    if reward_norm != "none" and (reward_shift != 0.0 or reward_scale != 1.0):
        raise ValueError(
            f"reward_shift / reward_scale only apply with reward_norm='none': {reward_norm!r} "
            "normalisation subtracts the mean and divides by the std, which cancels them"
        )
    if reward_norm == "group" and group_size < 2:
        raise ValueError("reward_norm='group' needs group_size >= 2 (a sample std needs two rewards)")
    if (reward_norm == "batch" or whiten_advantages) and rewards.numel() < 2:
        raise ValueError("batch normalisation / whitening needs at least 2 rewards")
    if (reward_norm == "running") != (running_stats is not None):
        raise ValueError("running_stats is required with reward_norm='running' and only applies to it")
    if not isinstance(whiten_advantages, bool):
        raise ValueError(f"whiten_advantages must be a bool, got {whiten_advantages!r}")
    if not bool(torch.isfinite(rewards).all()):
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        raise ValueError(f"rewards are NaN or inf at index(es) {bad[:8]}")

    # float64 so that equal rewards give an exactly zero centred value.
    raw = r = rewards.detach().to(torch.float64)
    if reward_clip is not None:
        r = r.clamp(-reward_clip, reward_clip)
    groups = r.view(-1, group_size)
    constant_group = groups.amax(dim=-1) == groups.amin(dim=-1)

    if reward_norm == "group":
        centred = groups - groups.mean(dim=-1, keepdim=True)
        centred = torch.where(constant_group.unsqueeze(-1), 0.0, centred)
        std = groups.std(dim=-1, keepdim=True) if group_size > 1 else torch.zeros_like(centred)
        adv = (centred / (std + eps)).flatten()
    elif reward_norm == "batch":
        adv = (r - r.mean()) / (r.std() + eps)
    elif reward_norm == "running":
        running_stats.update(r)
        adv = (r - running_stats.mean) / (running_stats.std + eps)
    else:
        adv = (r + reward_shift) * reward_scale

    if whiten_advantages:
        # Group-centred advantages have batch mean 0 by construction: only rescale them, so
        # that zero-advantage groups stay exactly zero instead of picking up rounding noise.
        centre = 0.0 if reward_norm == "group" else adv.mean()
        adv = (adv - centre) / (adv.std() + eps)
    metrics: dict[str, Tensor] = {}
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
