"""RunningMeanStd: mean and std of every reward seen so far, owned and checkpointed by the caller."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


class RunningMeanStd:
    """Streaming mean / sample std (Chan et al.'s parallel merge of count, mean, M2).

    The std uses Bessel's correction (divides M2 by count - 1), like
    :func:`~megatron_gspo.algorithms.advantages.compute_group_advantages`.
    State is three Python floats, so it checkpoints as a plain dict.
    """

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    def update(self, values: Tensor) -> None:
        """Adds a batch of finite values (any shape) to the statistics (one host synchronisation).

        Raises:
            ValueError: empty or non-finite values.
        """
        flat = values.detach().reshape(-1).to(torch.float64)
        if flat.numel() == 0:
            raise ValueError("RunningMeanStd.update got an empty tensor")
        batch_mean, batch_m2, finite = torch.stack(
            [flat.mean(), ((flat - flat.mean()) ** 2).sum(), torch.isfinite(flat).all().to(torch.float64)]
        ).tolist()
        if not finite:
            raise ValueError("RunningMeanStd.update got NaN or inf values")
        batch_count = flat.numel()
        total = self.count + batch_count
        delta = batch_mean - self.mean
        self.mean += delta * batch_count / total
        self.m2 += batch_m2 + delta * delta * self.count * batch_count / total
        self.count = total

    @property
    def std(self) -> float:
        """Sample standard deviation of all values seen.

        Raises:
            ValueError: fewer than two values seen.
        """
        if self.count < 2:
            raise ValueError(f"RunningMeanStd needs at least 2 values for a std, has {self.count}")
        return math.sqrt(self.m2 / (self.count - 1))

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: ``{"count": int, "mean": float, "m2": float}``."""
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict`.

        Raises:
            ValueError: missing / extra keys or invalid values.
        """
        expected = {"count", "mean", "m2"}
        if set(state) != expected:
            raise ValueError(f"RunningMeanStd state must have keys {sorted(expected)}, got {sorted(state)}")
        count, mean, m2 = int(state["count"]), float(state["mean"]), float(state["m2"])
        if count < 0 or m2 < 0 or not math.isfinite(mean) or not math.isfinite(m2):
            raise ValueError(f"invalid RunningMeanStd state {state}")
        self.count, self.mean, self.m2 = count, mean, m2
