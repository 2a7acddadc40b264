"""Expert-activation drift between two routings of the same tokens (pure torch).

A *routing* is `[T, num_layers, k]` expert ids: for each of T tokens and each MoE layer, the
k experts the router picked (order within a token does not matter; ids are distinct).

Per layer (GSPO paper, arXiv 2507.18071, sec. on MoE training; R3, arXiv 2510.11370):

    drift_l = mean over valid tokens of ( 1 - |topk_a(token, l) ∩ topk_b(token, l)| / k )

plus the fraction of valid tokens whose routing differs in at least one layer, and the
per-layer expert load shift: the L1 distance between the two load distributions over experts
(`load_a[e] = share of the T * k assignments going to expert e`), in [0, 2].

`drift_counts` returns additive sums (`DriftCounts`) so callers can add micro-batches and
all-reduce across ranks (`as_tensor` / `from_tensor`) before `summary()` divides once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _check(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None) -> None:
    if a.shape != b.shape or a.ndim != 3:
        raise ValueError(f"routings must both be [T, layers, k]; got {tuple(a.shape)} and {tuple(b.shape)}")
    if mask is not None and mask.shape != a.shape[:1]:
        raise ValueError(f"mask shape {tuple(mask.shape)} != [T]={a.shape[0]}")


def topk_overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`|a ∩ b|` per token and layer: `[T, layers, k]` x2 -> `[T, layers]` int64 (ids distinct per token)."""
    return (a.long().unsqueeze(-1) == b.long().unsqueeze(-2)).any(-1).sum(-1)


def expert_load(routing: torch.Tensor, num_experts: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Assignment counts per layer and expert: `[T, layers, k]` -> `[layers, num_experts]` float64."""
    r = routing.long()
    if mask is not None:
        r = r[mask.bool()]
    layers = r.shape[1]
    flat = (r + torch.arange(layers, device=r.device).view(1, -1, 1) * num_experts).reshape(-1)
    return torch.bincount(flat, minlength=layers * num_experts).view(layers, num_experts).double()


@dataclass
class DriftCounts:
    """Additive drift sums over a set of tokens.

    Attributes:
        changed: `[layers]` sum over tokens of `1 - overlap / k`.
        tokens: number of valid tokens.
        tokens_changed: valid tokens whose routing differs in >= 1 layer.
        load_a: `[layers, E]` assignment counts of routing a.
        load_b: `[layers, E]` assignment counts of routing b.
    """

    changed: torch.Tensor
    tokens: torch.Tensor
    tokens_changed: torch.Tensor
    load_a: torch.Tensor
    load_b: torch.Tensor

    def __add__(self, other: DriftCounts) -> DriftCounts:
        return DriftCounts(*(x + y for x, y in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        """The five sums in field order."""
        return (self.changed, self.tokens, self.tokens_changed, self.load_a, self.load_b)

    def as_tensor(self) -> torch.Tensor:
        """One flat float64 tensor (for a single all-reduce)."""
        return torch.cat([t.reshape(-1).double() for t in self.as_tuple()])

    @classmethod
    def from_tensor(cls, flat: torch.Tensor, num_layers: int, num_experts: int) -> DriftCounts:
        """Inverse of `as_tensor`."""
        sizes = [num_layers, 1, 1, num_layers * num_experts, num_layers * num_experts]
        parts = flat.split(sizes)
        return cls(
            parts[0],
            parts[1].reshape(()),
            parts[2].reshape(()),
            parts[3].view(num_layers, num_experts),
            parts[4].view(num_layers, num_experts),
        )

    def summary(self) -> DriftSummary:
        """Divide once: per-layer drift, changed-token fraction, per-layer load shift."""
        n = self.tokens.clamp(min=1)
        share_a = self.load_a / self.load_a.sum(-1, keepdim=True).clamp(min=1)
        share_b = self.load_b / self.load_b.sum(-1, keepdim=True).clamp(min=1)
        return DriftSummary(
            per_layer=(self.changed / n).float(),
            tokens_changed=float(self.tokens_changed / n),
            load_shift=(share_a - share_b).abs().sum(-1).float(),
            num_tokens=int(self.tokens),
        )


@dataclass
class DriftSummary:
    """Drift of routing b against routing a.

    Attributes:
        per_layer: `[layers]` mean fraction of a token's k experts that changed.
        tokens_changed: fraction of tokens whose routing differs in >= 1 layer.
        load_shift: `[layers]` L1 distance between the expert load distributions (0..2).
        num_tokens: valid tokens measured.
    """

    per_layer: torch.Tensor
    tokens_changed: float
    load_shift: torch.Tensor
    num_tokens: int

    @property
    def mean(self) -> float:
        """Drift averaged over layers (= over all (token, layer) routing decisions)."""
        return float(self.per_layer.mean())

    def metrics(self, prefix: str) -> dict[str, float]:
        """Flat scalar metrics: `{prefix}/mean`, `{prefix}/layer_{i}`, `{prefix}/tokens_changed`, ..."""
        out = {f"{prefix}/mean": self.mean, f"{prefix}/tokens_changed": self.tokens_changed}
        out.update({f"{prefix}/layer_{i}": float(v) for i, v in enumerate(self.per_layer)})
        out[f"{prefix}/load_shift_mean"] = float(self.load_shift.mean())
        return out


def drift_counts(
    a: torch.Tensor, b: torch.Tensor, *, num_experts: int, mask: torch.Tensor | None = None
) -> DriftCounts:
    """Sums behind the drift of routing b against a.

    Args:
        a: `[T, layers, k]` expert ids (reference, e.g. old policy or inference engine).
        b: `[T, layers, k]` expert ids of the same tokens (e.g. new policy or trainer).
        num_experts: experts per layer (load histograms).
        mask: `[T]` bool, True for tokens to count (padding and unrouted tokens False).
    """
    _check(a, b, mask)
    k = a.shape[-1]
    changed = 1.0 - topk_overlap(a, b).double() / k  # [T, layers]
    valid = torch.ones(a.shape[0], dtype=torch.bool, device=a.device) if mask is None else mask.bool()
    changed = changed[valid]
    return DriftCounts(
        changed=changed.sum(0),
        tokens=valid.sum().double(),
        tokens_changed=(changed > 0).any(-1).sum().double(),
        load_a=expert_load(a, num_experts, valid),
        load_b=expert_load(b, num_experts, valid),
    )


def routing_drift(
    a: torch.Tensor, b: torch.Tensor, *, num_experts: int, mask: torch.Tensor | None = None
) -> DriftSummary:
    """Drift of routing b against a on one process (see `drift_counts` for the arguments)."""
    return drift_counts(a, b, num_experts=num_experts, mask=mask).summary()
