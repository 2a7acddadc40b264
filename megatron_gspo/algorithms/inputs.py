"""Validation of the per-token tensors every loss in this package consumes.

Naming convention (used throughout ``megatron_gspo.algorithms``):

- ``log_probs``  [B, T]: log pi_theta of each sampled response token (differentiable).
- ``old_log_probs`` [B, T]: log pi_old of the same tokens (the rollout engine's log-probs).
- ``ref_log_probs`` [B, T]: log pi_ref of the same tokens (KL reference policy).
- ``advantages`` [B] (one per response) or [B, T] (one per token).
- ``response_mask`` [B, T]: True (or 1) where a position is a response token; everything
  else is padding and its values are ignored, even when they are NaN or inf.

All checks of one call are gathered into a single device-to-host transfer, so validating a
micro-batch costs one synchronisation, not one per check.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


class PolicyLossInputError(ValueError):
    """A tensor given to a loss is malformed; the message names the tensor and the problem."""


def check_response_mask_shape(response_mask: Tensor) -> None:
    """Checks the mask is a non-empty [B, T] tensor (shape only, no synchronisation).

    Args:
        response_mask: [B, T] bool or 0/1 tensor.

    Raises:
        PolicyLossInputError: if it is not a tensor, not 2-D, or has an empty dimension.
    """
    if not isinstance(response_mask, Tensor):
        kind = type(response_mask).__name__
        raise PolicyLossInputError(f"response_mask must be a torch.Tensor, got {kind}")
    if response_mask.dim() != 2:
        raise PolicyLossInputError(
            f"response_mask must be 2-D [B, T], got shape {tuple(response_mask.shape)}"
        )
    if response_mask.numel() == 0:
        raise PolicyLossInputError(
            f"response_mask is empty (shape {tuple(response_mask.shape)}): the batch holds no responses"
        )


def _check_same_shape(name: str, tensor: Tensor, shape: torch.Size) -> None:
    if not isinstance(tensor, Tensor):
        raise PolicyLossInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.shape != shape:
        raise PolicyLossInputError(
            f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} (the shape of response_mask)"
        )
    if not tensor.is_floating_point():
        raise PolicyLossInputError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")


def _first_position(bad: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in bad.nonzero()[0].tolist())


def validate_token_inputs(
    response_mask: Tensor,
    token_tensors: Mapping[str, Tensor],
    *,
    advantages: Tensor | None = None,
    normalizer: float | Tensor | None = None,
) -> Tensor:
    """Validates a batch of per-token tensors and returns the boolean response mask.

    Checks, with one host synchronisation: the mask is binary; every response (row) has at
    least one token; the tensors in ``token_tensors`` are finite at every masked-in position;
    ``advantages`` (if given) are finite where used; ``normalizer`` (if given) is finite and > 0.

    Args:
        response_mask: [B, T] bool or 0/1 tensor.
        token_tensors: name -> [B, T] floating tensor (e.g. ``log_probs``, ``old_log_probs``).
        advantages: optional [B] or [B, T] floating tensor.
        normalizer: optional positive scalar (float or 0-dim / 1-element tensor).

    Returns:
        [B, T] bool mask.

    Raises:
        PolicyLossInputError: naming the tensor, and the first offending row or position.
    """
    check_response_mask_shape(response_mask)
    shape = response_mask.shape
    for name, tensor in token_tensors.items():
        _check_same_shape(name, tensor, shape)
    if advantages is not None:
        if not isinstance(advantages, Tensor) or not advantages.is_floating_point():
            raise PolicyLossInputError("advantages must be a floating-point torch.Tensor")
        if advantages.shape not in (shape, shape[:1]):
            raise PolicyLossInputError(
                f"advantages has shape {tuple(advantages.shape)}, expected [B]={tuple(shape[:1])} "
                f"or [B, T]={tuple(shape)}"
            )
    normalizer_tensor = None
    if normalizer is not None:
        if isinstance(normalizer, Tensor):
            if normalizer.numel() != 1:
                raise PolicyLossInputError(
                    f"normalizer must be a scalar, got a tensor of shape {tuple(normalizer.shape)}"
                )
            normalizer_tensor = normalizer.reshape(())
        elif isinstance(normalizer, int | float) and not isinstance(normalizer, bool):
            if not (normalizer > 0 and normalizer != float("inf")):
                raise PolicyLossInputError(f"normalizer must be finite and > 0, got {normalizer}")
        else:
            kind = type(normalizer).__name__
            raise PolicyLossInputError(f"normalizer must be a number or a tensor, got {kind}")

    if response_mask.dtype == torch.bool:
        mask = response_mask
        not_binary = torch.zeros((), dtype=torch.bool, device=mask.device)
    else:
        not_binary = ((response_mask != 0) & (response_mask != 1)).any()
        mask = response_mask != 0
    empty_rows = mask.sum(dim=-1) == 0

    # One flag per check; a single .tolist() below transfers them all.
    flags = [not_binary, empty_rows.any()]
    nonfinite = {name: mask & ~torch.isfinite(t) for name, t in token_tensors.items()}
    flags += [bad.any() for bad in nonfinite.values()]
    if advantages is not None:
        adv_bad = ~torch.isfinite(advantages) & (mask if advantages.dim() == 2 else True)
        flags.append(adv_bad.any())
    if normalizer_tensor is not None:
        flags.append(~(torch.isfinite(normalizer_tensor) & (normalizer_tensor > 0)).to(mask.device))
    results = torch.stack([f.reshape(()) for f in flags]).tolist()
    if not any(results):
        return mask

    # Error path only: build a precise message (extra synchronisations are fine here).
    results = iter(results)
    if next(results):
        raise PolicyLossInputError("response_mask must contain only 0/1 (or bool) values")
    if next(results):
        rows = empty_rows.nonzero().flatten().tolist()
        if len(rows) == shape[0]:
            raise PolicyLossInputError("response_mask selects no tokens: every response is empty")
        raise PolicyLossInputError(
            f"response(s) at row(s) {rows[:8]} have zero tokens in response_mask; "
            "drop empty responses before computing the loss"
        )
    for name, bad in nonfinite.items():
        if next(results):
            raise PolicyLossInputError(
                f"{name} is NaN or inf at masked-in position (row, token) = {_first_position(bad)}"
            )
    if advantages is not None and next(results):
        raise PolicyLossInputError(
            f"advantages are NaN or inf at position {_first_position(adv_bad.expand_as(advantages))}"
        )
    if normalizer_tensor is not None and next(results):
        raise PolicyLossInputError(f"normalizer must be finite and > 0, got {normalizer_tensor.item()}")
    raise AssertionError("unreachable: a validation flag was set but not reported")  # pragma: no cover


def zero_masked(tensor: Tensor, mask: Tensor) -> Tensor:
    """Returns ``tensor`` with masked-out positions set to 0 (so NaN padding cannot leak).

    Args:
        tensor: [B, T] tensor.
        mask: [B, T] bool mask.

    Returns:
        [B, T] tensor; the gradient at masked-out positions is 0.
    """
    return torch.where(mask, tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device))
