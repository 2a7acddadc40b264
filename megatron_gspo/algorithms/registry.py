"""Policy-loss registry: a new loss is one function decorated with :func:`register_policy_loss`.

A registered loss function has the signature::

    fn(inputs: PolicyLossInputs, *, option_a=default, option_b=default) -> PolicyLossTerms

Its keyword-only parameters are its options; :func:`compute_policy_loss` rejects any option
a loss does not declare. Aggregation, validation and metrics are shared and live elsewhere:
the function only turns validated tensors into per-token losses and clip decisions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from megatron_gspo.algorithms.aggregation import check_loss_agg_mode
from megatron_gspo.algorithms.inputs import PolicyLossInputError, zero_masked


@dataclass(frozen=True)
class PolicyLossInputs:
    """Validated inputs of a policy loss; masked-out positions hold 0, never NaN.

    Attributes:
        log_probs: [B, T] log pi_theta of the sampled tokens (differentiable).
        old_log_probs: [B, T] log pi_old (detached).
        advantages: [B, T] per-token advantages (a [B] input broadcast over tokens), detached.
        sequence_advantages: [B] advantages if the caller gave one per response, else None.
        response_mask: [B, T] bool.
        lengths: [B] number of response tokens |y_i|, in the dtype of ``log_probs``.
    """

    log_probs: Tensor
    old_log_probs: Tensor
    advantages: Tensor
    sequence_advantages: Tensor | None
    response_mask: Tensor
    lengths: Tensor

    def token_log_ratio(self, clamp: float | None = None) -> Tensor:
        """Per-token log pi_theta - log pi_old, optionally clamped to [-clamp, clamp].

        Returns:
            [B, T] tensor, 0 at masked-out positions.
        """
        log_ratio = self.log_probs - self.old_log_probs
        if clamp is not None:
            log_ratio = log_ratio.clamp(-clamp, clamp)
        return zero_masked(log_ratio, self.response_mask)

    def sequence_log_ratio(self, clamp: float | None = None) -> Tensor:
        """Length-normalised sequence log-ratio 1/|y_i| sum_t (log pi_theta - log pi_old).

        Returns:
            [B] tensor, optionally clamped to [-clamp, clamp].
        """
        log_ratio = self.token_log_ratio().sum(dim=-1) / self.lengths
        if clamp is not None:
            log_ratio = log_ratio.clamp(-clamp, clamp)
        return log_ratio

    def require_sequence_advantages(self, loss_type: str) -> Tensor:
        """Returns the [B] advantages, or raises if per-token advantages were given."""
        if self.sequence_advantages is None:
            raise PolicyLossInputError(
                f"{loss_type!r} takes one advantage per response, shape [B]; got per-token advantages "
                f"[B, T] (use 'gspo_token' for per-token advantages)"
            )
        return self.sequence_advantages


@dataclass(frozen=True)
class PolicyLossTerms:
    """What a loss function returns; shared code aggregates it and derives the metrics.

    Attributes:
        token_losses: [B, T] per-token loss to minimise (the negated objective), aggregated by
            ``loss_agg_mode``. Sequence-level losses repeat their per-response term on each token.
        ratio: detached importance ratio the loss acts on: [B] for sequence-level ratios,
            [B, T] for token-level ones.
        clipped_low: [B, T] bool, the clip is active below the trust region (gradient zeroed).
        clipped_high: [B, T] bool, the clip is active above the trust region.
        token_metrics: extra name -> [B, T] detached quantities, reported as masked means.
    """

    token_losses: Tensor
    ratio: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    token_metrics: Mapping[str, Tensor] = field(default_factory=dict)


PolicyLossFn = Callable[..., PolicyLossTerms]


@dataclass(frozen=True)
class PolicyLossSpec:
    """A registered policy loss.

    Attributes:
        name: registry key (``loss_type``).
        fn: the loss function.
        options: option name -> default value (the function's keyword-only parameters).
        default_agg_mode: aggregation used when the caller does not choose one.
        sequence_ratio: True for losses built on GSPO's length-normalised sequence ratio;
            those refuse token-sum aggregation modes unless explicitly forced.
    """

    name: str
    fn: PolicyLossFn
    options: Mapping[str, Any]
    default_agg_mode: str
    sequence_ratio: bool


class PolicyLossRegistry:
    """Name -> :class:`PolicyLossSpec`; rejects duplicate names, lists valid names on a miss."""

    def __init__(self) -> None:
        self._specs: dict[str, PolicyLossSpec] = {}

    def register(
        self, name: str, *, default_agg_mode: str = "seq-mean-token-mean", sequence_ratio: bool = False
    ) -> Callable[[PolicyLossFn], PolicyLossFn]:
        """Decorator registering ``fn`` under ``name`` (see the module docstring for the signature).

        Args:
            name: the ``loss_type`` string.
            default_agg_mode: aggregation used when the caller passes none.
            sequence_ratio: the loss uses a length-normalised sequence ratio (GSPO family).

        Returns:
            The decorator; it returns ``fn`` unchanged.

        Raises:
            ValueError: duplicate name or unknown default mode.
            TypeError: the function's signature does not follow the contract.
        """
        check_loss_agg_mode(default_agg_mode)
        if not isinstance(name, str) or not name:
            raise ValueError(f"policy loss name must be a non-empty string, got {name!r}")

        def decorator(fn: PolicyLossFn) -> PolicyLossFn:
            if name in self._specs:
                raise ValueError(
                    f"policy loss {name!r} is already registered (by {self._specs[name].fn.__qualname__})"
                )
            params = list(inspect.signature(fn).parameters.values())
            if not params or params[0].kind not in (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            ):
                raise TypeError(f"policy loss {name!r}: first parameter must be the positional `inputs`")
            options = {}
            for param in params[1:]:
                keyword_only = param.kind is inspect.Parameter.KEYWORD_ONLY
                if not keyword_only or param.default is inspect.Parameter.empty:
                    raise TypeError(
                        f"policy loss {name!r}: option {param.name!r} must be keyword-only with a default"
                    )
                options[param.name] = param.default
            self._specs[name] = PolicyLossSpec(
                name=name,
                fn=fn,
                options=MappingProxyType(options),
                default_agg_mode=default_agg_mode,
                sequence_ratio=sequence_ratio,
            )
            return fn

        return decorator

    def get(self, name: str) -> PolicyLossSpec:
        """Returns the spec registered as ``name``.

        Raises:
            ValueError: unknown name; the message lists the registered ones.
        """
        try:
            return self._specs[name]
        except KeyError:
            raise ValueError(
                f"unknown policy loss {name!r}; supported: {', '.join(sorted(self._specs))}"
            ) from None

    def unregister(self, name: str) -> None:
        """Removes ``name`` (raises ValueError listing the registered names if absent)."""
        self.get(name)
        del self._specs[name]

    def names(self) -> tuple[str, ...]:
        """Registered loss names, sorted."""
        return tuple(sorted(self._specs))

    def __contains__(self, name: object) -> bool:
        return name in self._specs


POLICY_LOSSES = PolicyLossRegistry()
"""The registry :func:`compute_policy_loss` looks losses up in."""

register_policy_loss = POLICY_LOSSES.register


def check_fraction(name: str, value: Any, *, upper_open: float | None = None) -> float:
    """Checks an option is a real number >= 0 (and < ``upper_open`` if given).

    Returns:
        The value as float.

    Raises:
        ValueError: naming the option.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ValueError(f"option {name} must be a real number, got {value!r}")
    if value < 0 or (upper_open is not None and value >= upper_open):
        bound = f"in [0, {upper_open})" if upper_open is not None else ">= 0"
        raise ValueError(f"option {name} must be {bound}, got {value}")
    return float(value)


def check_positive(name: str, value: Any, *, above: float = 0.0) -> float:
    """Checks an option is a finite real number > ``above``.

    Returns:
        The value as float.

    Raises:
        ValueError: naming the option.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"option {name} must be a real number, got {value!r}")
    if not (value > above and value != float("inf")):
        raise ValueError(f"option {name} must be finite and > {above}, got {value}")
    return float(value)


def no_clip(mask: Tensor) -> Tensor:
    """All-False [B, T] clip mask for losses without a hard clip."""
    return torch.zeros_like(mask, dtype=torch.bool)
