"""Rollout correction: reweight or mask the policy loss by pi_old / pi_rollout (train/inference gap).

Three policies, as in decoupled PPO (Hilton et al., arXiv 2110.00641) and verl's rollout
correction: pi_rollout sampled the responses (SGLang's ``rollout_logprobs``), pi_old is the
trainer's own forward with the same weights (``old_logprobs``, the recompute pass), and the
policy loss clips pi_theta / pi_old. The engines' numeric gap pi_old != pi_rollout is what the
correction acts on, through the per-token ratio and its length-normalised sequence form::

    rho_it = pi_old(y_it) / pi_rollout(y_it)
    rho_i  = exp(1/|y_i| sum_t log rho_it)   level sequence: the geometric mean (GSPO's length
                                             normalisation)
    rho_i  = exp(sum_t log rho_it)           level sequence_product: the product of the token
                                             ratios (the papers' sequence-level TIS / MIS)

Every comparison with a bound is made in log space, so a product over thousands of tokens never
overflows: a weight is only exponentiated at or below its cap.

Each method gives a detached weight ``w`` multiplying the per-token loss ``l_it`` before
aggregation (``rho`` is ``rho_it`` at token level, ``rho_i`` on every token of response i at
sequence level):

- ``tis``, truncated importance sampling (Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training"; verl ``rollout_is``): ``w = min(rho, C)``.
- ``mis``, masked importance sampling as published ("When Speed Kills Stability", Liu et al.
  2025): ``w = rho if rho <= C else 0``: reweighted below the cap, dropped above it.
- ``reject``, rejection sampling in a band (verl ``rollout_rs``):
  ``w = 1 if lo <= rho <= hi else 0``: the token (or the whole response) is dropped.
- ``icepop`` (Ring-1T report, arXiv 2510.18855), token level only: ``w = M(rho_it)`` with
  ``M(k) = k`` on ``[lo, hi]`` (default [0.5, 5]) and 0 outside: reweighted inside the band,
  dropped outside.

How it composes with the loss (``r_it = pi_theta / pi_old``, ``s_i`` GSPO's sequence ratio):

- token-ratio losses (``grpo``, ``sapo``): token level ``l_it = -w_it min(r_it A, clip(r_it) A)``;
  sequence level puts ``w_i`` on every token of response i.
- sequence-ratio losses (``gspo``, ``gspo_token``): sequence level only,
  ``l_i = -w_i min(s_i A_i, clip(s_i) A_i)``; with truncation inactive ``s_i rho_i =
  exp(mean_t log(pi_theta / pi_rollout))``, the same length-normalised form as s_i itself. A
  token weight cannot act inside s_i: every token's log-ratio still enters s_i (its value, its
  clip decision and, for gspo, its gradient), so a token mask would drop nothing and a token
  weight would only rescale the response by its token average. Refused (``check_loss``).

Dropped tokens and responses keep their place in the loss normaliser (``w = 0``, not removed
from ``response_mask``): this is IcePop's ``1/|y_i| sum_t M(k) (...)``, and a fully rejected
response cannot leave a micro-batch empty. The weights are computed once per step (pi_old and
pi_rollout do not change during it), in float32 on the tensors' device, with no host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_gspo.algorithms.inputs import zero_masked

CORRECTION_METHODS: tuple[str, ...] = ("none", "tis", "mis", "reject", "icepop")
CORRECTION_LEVELS: tuple[str, ...] = ("token", "sequence", "sequence_product")
DEFAULT_CAPS = {"tis": 2.0, "mis": 2.0}
DEFAULT_BANDS = {"reject": (0.5, 2.0), "icepop": (0.5, 5.0)}


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"rollout_correction.{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RolloutCorrection:
    """A validated correction; build it with :meth:`build`.

    Attributes:
        method: one of :data:`CORRECTION_METHODS`.
        level: ``token`` or ``sequence``.
        cap: C of ``tis`` and ``mis`` (None for the other methods).
        low: lower bound of the kept band (``reject``, ``icepop``), else None.
        high: upper bound of the kept band (``reject``, ``icepop``), else None.
    """

    method: str = "none"
    level: str = "token"
    cap: float | None = None
    low: float | None = None
    high: float | None = None

    @classmethod
    def build(
        cls,
        method: str = "none",
        level: str = "token",
        *,
        cap: float | None = None,
        low: float | None = None,
        high: float | None = None,
    ) -> RolloutCorrection:
        """Checks the options and fills the method's defaults.

        Args:
            method: ``none``, ``tis``, ``mis``, ``reject`` or ``icepop``.
            level: ``token``, ``sequence`` or ``sequence_product`` (``icepop``: token only).
            cap: ``tis`` / ``mis`` only: C >= 1 (default 2); a cap below 1 would down-weight
                (tis) or drop (mis) tokens on which the engines agree.
            low: ``reject`` / ``icepop`` only: lower bound, 0 <= low <= 1 (default 0.5).
            high: ``reject`` / ``icepop`` only: upper bound >= 1, > low (defaults 2 / 5).

        Raises:
            ValueError: naming ``rollout_correction.<field>``: an unknown method or level, an
                option the method does not take, a bound that is not finite or out of range.
        """
        if method not in CORRECTION_METHODS:
            raise ValueError(f"rollout_correction.method={method!r}; valid: {', '.join(CORRECTION_METHODS)}")
        if level not in CORRECTION_LEVELS:
            raise ValueError(f"rollout_correction.level={level!r}; valid: {', '.join(CORRECTION_LEVELS)}")
        given = {name for name, value in (("cap", cap), ("low", low), ("high", high)) if value is not None}
        takes = {
            "none": set(),
            "tis": {"cap"},
            "mis": {"cap"},
            "reject": {"low", "high"},
            "icepop": {"low", "high"},
        }[method]
        if given - takes:
            raise ValueError(
                f"rollout_correction.{', '.join(sorted(given - takes))} does not apply to method {method!r} "
                f"(it takes: {', '.join(sorted(takes)) or 'nothing'})"
            )
        if method == "none":
            return cls()
        if method == "icepop" and level != "token":
            raise ValueError(
                f"rollout_correction.level={level} with method 'icepop': IcePop masks tokens; "
                "use method 'reject' (or 'mis') for sequence-level rejection"
            )
        if method in DEFAULT_CAPS:
            cap = DEFAULT_CAPS[method] if cap is None else _real("cap", cap)
            if cap < 1:
                raise ValueError(
                    f"rollout_correction.cap must be >= 1, got {cap}: a cap below 1 would down-weight or "
                    "drop tokens on which the rollout and training engines agree (rho = 1)"
                )
            return cls(method, level, cap=cap)
        default_low, default_high = DEFAULT_BANDS[method]
        low = default_low if low is None else _real("low", low)
        high = default_high if high is None else _real("high", high)
        if not 0 <= low <= 1 <= high or low >= high:
            raise ValueError(
                f"rollout_correction.low={low}, high={high}: need 0 <= low <= 1 <= high and low < high "
                "(the kept band must contain rho = 1, where the engines agree)"
            )
        return cls(method, level, low=low, high=high)

    @property
    def enabled(self) -> bool:
        """Whether the correction changes the loss (method other than ``none``)."""
        return self.method != "none"

    def check_loss(self, loss_type: str, sequence_ratio: bool) -> None:
        """Refuses a token-level correction for a sequence-ratio loss (see the module docstring).

        Args:
            loss_type: the policy loss's name, for the message.
            sequence_ratio: the loss is built on GSPO's sequence ratio (``PolicyLossSpec``).

        Raises:
            ValueError: naming ``rollout_correction.level``.
        """
        if self.enabled and sequence_ratio and self.level == "token":
            icepop = " (icepop is token-level only: use mis)" if self.method == "icepop" else ""
            raise ValueError(
                f"rollout_correction.level=token with loss {loss_type!r}: GSPO clips one sequence ratio "
                "s_i built from every token, so a token weight or mask cannot remove a token from it (it "
                "would only rescale the response); use level=sequence, whose geometric-mean weight "
                f"matches s_i's length normalisation, or sequence_product{icepop}"
            )

    @torch.no_grad()
    def weights(
        self, old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The per-token loss weights of one micro-batch and their metrics.

        Args:
            old_log_probs: [B, T] log pi_old (the trainer's recompute with the rollout weights).
            rollout_log_probs: [B, T] log pi_rollout (the rollout engine's).
            response_mask: [B, T] bool or 0/1; every row has at least one token.

        Returns:
            (weights, metrics): [B, T] float32 weights, 0 off the response; detached 0-dim
            metrics ``rollout_corr/weight_mean`` and ``_max`` (of ``w`` over response tokens),
            and for ``tis`` ``rollout_corr/truncfrac_tokens`` / ``_seq`` (tokens truncated /
            responses with a truncated token), for ``mis``, ``reject`` and ``icepop``
            ``rollout_corr/maskfrac_tokens`` / ``_seq`` (tokens dropped / responses with a
            dropped token). Method ``none``: all-ones weights, no metrics.
        """
        mask = response_mask.bool()
        if not self.enabled:
            return mask.float(), {}
        log_rho = zero_masked(old_log_probs.float() - rollout_log_probs.float(), mask)
        if self.level == "sequence":
            log_rho = (log_rho.sum(dim=-1) / mask.sum(dim=-1)).unsqueeze(-1).expand_as(log_rho)
        elif self.level == "sequence_product":
            log_rho = log_rho.sum(dim=-1, keepdim=True).expand_as(log_rho)
        if self.method in DEFAULT_CAPS:
            log_cap = math.log(self.cap)
            changed = log_rho > log_cap
            below = torch.exp(log_rho.clamp(max=log_cap))  # never exponentiated above the cap
            w = below if self.method == "tis" else torch.where(changed, 0.0, below)
            kind = "truncfrac" if self.method == "tis" else "maskfrac"
        else:  # compared in log space: exact, and no overflow for wild tokens
            log_low = math.log(self.low) if self.low > 0 else -math.inf
            log_high = math.log(self.high)
            kept = (log_rho >= log_low) & (log_rho <= log_high)
            changed = ~kept
            inside = torch.exp(log_rho.clamp(max=log_high)) if self.method == "icepop" else 1.0
            w = torch.where(kept, inside, 0.0)
            kind = "maskfrac"
        w = zero_masked(w, mask)
        changed = changed & mask
        count = mask.sum()
        metrics = {
            "rollout_corr/weight_mean": w.sum() / count,
            "rollout_corr/weight_max": torch.where(mask, w, -torch.inf).max(),
            f"rollout_corr/{kind}_tokens": changed.sum() / count,
            f"rollout_corr/{kind}_seq": changed.any(dim=-1).float().mean(),
        }
        return w, metrics
