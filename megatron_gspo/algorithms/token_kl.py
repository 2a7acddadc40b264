"""Reward-side KL (ROLL's ``add_token_level_kl``): a per-token reward of -beta x KL and its returns.

ROLL (``compute_token_reward``, ``compute_advantage`` with the ``reinforce`` estimator, gamma 1)
puts the response's (normalised, clipped) reward on its last token, subtracts
``beta * kl_t`` on every response token, with ``kl_t`` an estimator of KL(pi_old || pi_ref) on
the sampled token (``kl_penalty``, default ``k1``: log pi_old - log pi_ref), clips the token
rewards to [-reward_clip, reward_clip], and takes each token's return as the sum of the rewards
from it to the end::

    A_it = sum_{t' >= t} r_it',   r_it = -beta kl_it + [t = last] R_i

so the advantages become per token. beta comes from a controller (Ziegler et al., arXiv
1909.08593, as verl and ROLL compute it): ``fixed`` keeps ``init_kl_coef``; ``adaptive``
multiplies it after every step by ``1 + clip(kl / target - 1, -0.2, 0.2) x n / horizon`` with
``kl`` the batch's mean over responses of each response's mean ``kl_t`` and ``n`` the responses.
Whitening and the advantage clip come after, over the whole batch (the caller's, since they span
data-parallel ranks).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from megatron_gspo.algorithms.kl import kl_penalty

KL_CONTROLLERS: tuple[str, ...] = ("fixed", "adaptive")


class KLController:
    """beta of the reward-side KL: fixed, or adapted towards a target KL (checkpointable).

    Args:
        init_kl_coef: beta at the start, >= 0.
        kind: ``fixed`` or ``adaptive``.
        target_kl: the KL the adaptive controller steers to (> 0; adaptive only).
        horizon: responses over which a full proportional step acts (> 0; adaptive only).
    """

    def __init__(
        self, init_kl_coef: float, kind: str = "fixed", target_kl: float | None = None, horizon: int = 10000
    ) -> None:
        if kind not in KL_CONTROLLERS:
            raise ValueError(f"kl_ctl={kind!r}; valid: {', '.join(KL_CONTROLLERS)}")
        if not math.isfinite(init_kl_coef) or init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be a finite number >= 0, got {init_kl_coef}")
        if kind == "adaptive" and (target_kl is None or target_kl <= 0 or horizon <= 0):
            raise ValueError(
                f"kl_ctl=adaptive needs target_kl > 0 and kl_horizon > 0, got {target_kl}, {horizon}"
            )
        self.kind, self.target, self.horizon = kind, target_kl, horizon
        self.value = float(init_kl_coef)

    def update(self, current_kl: float, num_responses: int) -> None:
        """After a step: move beta by the proportional error of the step's KL (adaptive only)."""
        if self.kind == "fixed":
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * num_responses / self.horizon

    def state_dict(self) -> dict[str, Any]:
        """``{"value": beta}`` (the rest is configuration)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`."""
        self.value = float(state["value"])


@torch.no_grad()
def token_level_kl_returns(
    rewards: Tensor,
    old_log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    *,
    beta: float,
    estimator: str = "k1",
    reward_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token returns of one batch of responses with the reward-side KL.

    Args:
        rewards: [B] each response's (normalised, clipped) reward.
        old_log_probs: [B, T] log pi_old of the sampled tokens.
        ref_log_probs: [B, T] log pi_ref.
        response_mask: [B, T] bool; every row has a response token.
        beta: the KL coefficient (the controller's value before this step's update).
        estimator: ``k1``, ``k2``, ``k3`` or ``low_var_kl`` (ROLL's ``kl_penalty``).
        reward_clip: clip of each token's reward, or None.

    Returns:
        (returns [B, T] float32, 0 off the response; per-response mean KL [B] float32).
    """
    mask = response_mask.bool()
    kl = torch.where(mask, kl_penalty(old_log_probs.double(), ref_log_probs.double(), estimator), 0.0)
    last = mask & (mask.cumsum(dim=-1) == mask.sum(dim=-1, keepdim=True))
    token_rewards = -beta * kl + torch.where(last, rewards.double().unsqueeze(-1), 0.0)
    if reward_clip is not None:
        token_rewards = token_rewards.clamp(-reward_clip, reward_clip)
    token_rewards = torch.where(mask, token_rewards, 0.0)
    returns = token_rewards.flip(-1).cumsum(dim=-1).flip(-1)
    returns = torch.where(mask, returns, 0.0)
    return returns.float(), (kl.sum(dim=-1) / mask.sum(dim=-1)).float()
