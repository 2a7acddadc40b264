"""Typed rollout records: one `RolloutSample` per response, one `RolloutBatch` per training step.

Glossary and shapes (``P``/``R`` prompt/response lengths of one sample, ``B`` samples in a batch,
``G`` responses per prompt, ``S`` the padded sequence length, ``L`` MoE layers, ``k`` experts per
token):

- ``tokens [B, S]`` int64: prompt then response, right-padded with ``pad_token_id``.
- ``response_mask [B, S]`` float32: 1.0 exactly on the response tokens
  ``tokens[b, P_b : P_b + R_b]``, 0.0 on the prompt and padding.
- ``rollout_logprobs [B, S]`` float32, aligned with ``tokens``:
  ``rollout_logprobs[b, t] = log pi_old(tokens[b, t] | tokens[b, :t])`` wherever
  ``response_mask[b, t] == 1``, and 0.0 elsewhere. A model's logits at position ``t - 1``
  predict token ``t``, so the trainer's log-probs in the same layout are
  ``logprobs[:, 1:] = log_softmax(logits[:, :-1]).gather(-1, tokens[:, 1:])`` (position 0
  never has a log-prob; it is always a prompt token since ``P >= 1``).
- ``routed_experts``: per sample ``[P + R - 1, L, k]`` (uint8/int16); row ``t`` is the routing
  the rollout engine used for the token at position ``t`` (the last response token is never
  run through the rollout model, hence ``- 1``).
- Rows are group-major: rows ``[g * G, (g + 1) * G)`` are the ``G`` responses to prompt ``g``,
  so ``rewards.view(-1, G)`` gives per-group rewards.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import torch

from megatron_gspo.rollout.errors import (
    BatchLayoutError,
    EmptyBatchError,
    EmptyResponseError,
    GroupError,
    InvalidLogprobError,
    LengthMismatchError,
    RolloutValidationError,
    RoutedExpertsError,
    StaleRolloutError,
)


@dataclasses.dataclass
class RolloutSample:
    """One generated response with what the trainer needs from the rollout engine.

    Attributes:
        prompt_ids: prompt token ids ``[P]`` int64 (``P >= 1``).
        response_ids: generated token ids ``[R]`` int64 (``R >= 1``).
        rollout_logprobs: log pi_old of each generated token ``[R]`` float32.
        finish_reason: ``"stop"`` (EOS / stop string) or ``"length"`` (max_new_tokens reached).
        weight_version: the engine's weight version that generated it, or None if unreported.
        routed_experts: expert ids ``[P + R - 1, L, k]`` (uint8/int16), or None.
        group_index: which prompt group the sample belongs to (None: consecutive groups of G).
        reward: the scalar reward, once scored.
        rid: the request id, used to name the sample in errors.
    """

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    rollout_logprobs: torch.Tensor
    finish_reason: str
    weight_version: str | None
    routed_experts: torch.Tensor | None = None
    group_index: int | None = None
    reward: float | None = None
    rid: str | None = None

    @property
    def prompt_length(self) -> int:
        """``P``."""
        return int(self.prompt_ids.numel())

    @property
    def response_length(self) -> int:
        """``R``."""
        return int(self.response_ids.numel())


def sample_problem(
    sample: RolloutSample, name: str | int, *, check_logprobs: bool = True
) -> RolloutValidationError | None:
    """The first structural inconsistency of a sample, or None (cheap re-check at the batch boundary).

    `check_logprobs=False` skips the value checks of `rollout_logprobs` (finite, <= 0), for
    samples whose log-probs were checked together (`_logprobs_valid`).
    """
    if sample.prompt_ids.ndim != 1 or sample.prompt_ids.numel() == 0:
        return EmptyResponseError(
            "prompt_ids",
            f"expected a non-empty 1-D tensor, got {tuple(sample.prompt_ids.shape)}",
            sample=name,
        )
    if sample.response_ids.ndim != 1 or sample.response_ids.numel() == 0:
        return EmptyResponseError(
            "response_ids",
            f"expected a non-empty 1-D tensor, got {tuple(sample.response_ids.shape)}",
            sample=name,
        )
    logprobs = sample.rollout_logprobs
    if logprobs.shape != sample.response_ids.shape:
        return LengthMismatchError(
            "rollout_logprobs",
            f"shape {tuple(logprobs.shape)} != {tuple(sample.response_ids.shape)} of response_ids",
            sample=name,
        )
    if check_logprobs and not torch.isfinite(logprobs).all():
        return InvalidLogprobError("rollout_logprobs", "contains NaN or inf", sample=name)
    if check_logprobs and (logprobs > 0).any():
        return InvalidLogprobError(
            "rollout_logprobs", f"contains positive values (max {logprobs.max().item()})", sample=name
        )
    if sample.routed_experts is not None:
        rows = sample.prompt_length + sample.response_length - 1
        if sample.routed_experts.ndim != 3 or sample.routed_experts.shape[0] != rows:
            return RoutedExpertsError(
                "routed_experts",
                f"shape {tuple(sample.routed_experts.shape)}, expected [P+R-1={rows}, layers, topk]",
                sample=name,
            )
    return None


@dataclasses.dataclass
class RolloutBatch:
    """A validated, padded training batch of complete prompt groups (see the module docstring).

    Attributes:
        tokens: ``[B, S]`` int64, prompt + response, right-padded.
        response_mask: ``[B, S]`` float32, 1.0 on response tokens.
        attention_mask: ``[B, S]`` bool, True on prompt and response tokens.
        rollout_logprobs: ``[B, S]`` float32, token-aligned log pi_old, 0.0 off the response.
        prompt_lengths: ``[B]`` int64.
        response_lengths: ``[B]`` int64.
        rewards: ``[B]`` float32; a sample's reward if already scored, else NaN until filled.
        group_size: ``G``.
        routed_experts: per sample ``[P + R - 1, L, k]``, or None when the rollouts carry none.
        weight_versions: per sample, the engine weight version.
        finish_reasons: per sample, ``"stop"`` or ``"length"``.
        samples: the kept samples, in row order.
        stats: counts of groups/samples received, kept and dropped (by reason).
    """

    tokens: torch.Tensor
    response_mask: torch.Tensor
    attention_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    rewards: torch.Tensor
    group_size: int
    routed_experts: list[torch.Tensor] | None
    weight_versions: list[str | None]
    finish_reasons: list[str]
    samples: list[RolloutSample]
    stats: dict[str, int]

    @property
    def batch_size(self) -> int:
        """``B``."""
        return int(self.tokens.shape[0])

    @property
    def num_groups(self) -> int:
        """``B / G``."""
        return self.batch_size // self.group_size

    def padded_routed_experts(self) -> torch.Tensor | None:
        """Routed experts as one ``[B, S, L, k]`` tensor; rows ``t >= P_b + R_b - 1`` (no routing) are 0."""
        if self.routed_experts is None:
            return None
        first = self.routed_experts[0]
        out = torch.zeros((self.batch_size, self.tokens.shape[1], *first.shape[1:]), dtype=first.dtype)
        for b, routes in enumerate(self.routed_experts):
            out[b, : routes.shape[0]] = routes
        return out

    @classmethod
    def from_samples(
        cls,
        samples: Sequence[RolloutSample],
        group_size: int,
        *,
        expected_weight_version: str | int | None = None,
        on_invalid: Literal["raise", "drop"] = "raise",
        pad_token_id: int = 0,
    ) -> RolloutBatch:
        """Check and pad samples into a batch of complete groups.

        Groups are formed by ``group_index`` when every sample has one (order of first
        appearance), else by consecutive runs of ``group_size``. A group is bad when it does not
        have exactly ``group_size`` samples, its samples do not share one prompt, one sample is
        structurally inconsistent, or (with ``expected_weight_version``) one sample was generated
        by another weight version (stale). ``on_invalid="raise"`` raises on the first bad group;
        ``"drop"`` drops the whole group (group advantages need full groups) and counts it in
        ``stats``. Layout disagreements across groups (routed experts present in some samples
        only, different ``[L, k]``) always raise.

        Args:
            samples: the parsed samples.
            group_size: ``G``, responses per prompt.
            expected_weight_version: the engine weight version the trainer expects, or None to
                skip the staleness check.
            on_invalid: ``"raise"`` or ``"drop"``.
            pad_token_id: the id used to right-pad ``tokens``.

        Returns:
            The batch; ``stats`` holds ``groups_in``, ``groups_kept``, ``samples_kept``,
            ``dropped_groups``, ``dropped_samples`` and per-reason group counts
            ``dropped_incomplete``, ``dropped_prompt_mismatch``, ``dropped_invalid``,
            ``dropped_stale``.

        Raises:
            GroupError, StaleRolloutError, RolloutValidationError: in raise mode, for a bad group.
            BatchLayoutError: samples disagree in layout.
            EmptyBatchError: no group is left.
        """
        if on_invalid not in ("raise", "drop"):
            raise ValueError(f"on_invalid must be 'raise' or 'drop', got {on_invalid!r}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        groups = _group(samples, group_size)
        expected = None if expected_weight_version is None else str(expected_weight_version)
        stats = dict.fromkeys(
            (
                "groups_in", "groups_kept", "samples_kept", "dropped_groups", "dropped_samples",
                "dropped_incomplete", "dropped_prompt_mismatch", "dropped_invalid", "dropped_stale",
            ),
            0,
        )  # fmt: skip
        stats["groups_in"] = len(groups)
        kept: list[RolloutSample] = []
        check_logprobs = not _logprobs_valid(samples)  # one check for all; per sample only to name one
        for key, members in groups:
            problem, reason = _group_problem(key, members, group_size, expected, check_logprobs)
            if problem is None:
                kept.extend(members)
                stats["groups_kept"] += 1
                continue
            if on_invalid == "raise":
                raise problem
            stats["dropped_groups"] += 1
            stats["dropped_samples"] += len(members)
            stats[f"dropped_{reason}"] += 1
        if not kept:
            raise EmptyBatchError(
                "samples", f"no complete, valid group left out of {len(groups)} (stats: {stats})"
            )
        stats["samples_kept"] = len(kept)
        return cls._pad(kept, group_size, stats, pad_token_id)

    @classmethod
    def _pad(
        cls, samples: list[RolloutSample], group_size: int, stats: dict[str, int], pad: int
    ) -> RolloutBatch:
        routes = [s.routed_experts for s in samples]
        with_routes = sum(r is not None for r in routes)
        if 0 < with_routes < len(samples):
            raise BatchLayoutError(
                "routed_experts", f"present in {with_routes} of {len(samples)} samples (all or none)"
            )
        if with_routes and len({(tuple(r.shape[1:]), r.dtype) for r in routes}) > 1:
            layouts = sorted({f"{tuple(r.shape[1:])}/{r.dtype}" for r in routes})
            raise BatchLayoutError("routed_experts", f"samples disagree in [layers, topk]/dtype: {layouts}")
        prompt_lengths = torch.tensor([s.prompt_length for s in samples], dtype=torch.int64)
        response_lengths = torch.tensor([s.response_length for s in samples], dtype=torch.int64)
        seq_len = int((prompt_lengths + response_lengths).max())
        ends = prompt_lengths + response_lengths
        positions = torch.arange(seq_len)
        attention_mask = positions < ends[:, None]
        in_response = attention_mask & (positions >= prompt_lengths[:, None])
        # One scatter per field instead of one slice per sample: rows and columns of every token.
        flat_tokens = torch.cat([t for s in samples for t in (s.prompt_ids, s.response_ids)])
        tokens = torch.full((len(samples), seq_len), pad, dtype=torch.int64)
        tokens[attention_mask] = flat_tokens.to(torch.int64)
        flat_logprobs = torch.cat([s.rollout_logprobs for s in samples])
        rollout_logprobs = torch.zeros((len(samples), seq_len), dtype=torch.float32)
        rollout_logprobs[in_response] = flat_logprobs.to(torch.float32)
        response_mask = in_response.to(torch.float32)
        rewards = torch.tensor(
            [math.nan if s.reward is None else float(s.reward) for s in samples], dtype=torch.float32
        )
        return cls(
            tokens=tokens,
            response_mask=response_mask,
            attention_mask=attention_mask,
            rollout_logprobs=rollout_logprobs,
            prompt_lengths=prompt_lengths,
            response_lengths=response_lengths,
            rewards=rewards,
            group_size=group_size,
            routed_experts=list(routes) if with_routes else None,
            weight_versions=[s.weight_version for s in samples],
            finish_reasons=[s.finish_reason for s in samples],
            samples=samples,
            stats=stats,
        )


def _group(samples: Sequence[RolloutSample], group_size: int) -> list[tuple[int, list[RolloutSample]]]:
    """``[(group key, members)]`` by ``group_index`` if all samples have one, else consecutive runs."""
    indexed = [s.group_index is not None for s in samples]
    if any(indexed) and not all(indexed):
        raise GroupError(
            "group_index", f"set on {sum(indexed)} of {len(samples)} samples; set it on all or none"
        )
    if not all(indexed) or not samples:
        return [
            (g, list(samples[i : i + group_size])) for g, i in enumerate(range(0, len(samples), group_size))
        ]
    groups: dict[int, list[RolloutSample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return list(groups.items())


def _logprobs_valid(samples: list[RolloutSample]) -> bool:
    """Whether every sample's `rollout_logprobs` is a 1-D float tensor of finite values <= 0."""
    logprobs = [s.rollout_logprobs for s in samples]
    if not logprobs or not all(isinstance(lp, torch.Tensor) and lp.ndim == 1 for lp in logprobs):
        return False
    flat = torch.cat(logprobs)
    return bool(flat.is_floating_point() and torch.isfinite(flat).all() and not (flat > 0).any())


def _group_problem(
    key: int,
    members: list[RolloutSample],
    group_size: int,
    expected: str | None,
    check_logprobs: bool = True,
) -> tuple[RolloutValidationError | None, str]:
    """The first reason a group must not be trained on, and its stats name."""
    if len(members) != group_size:
        return GroupError(
            "group_size",
            f"group {key} has {len(members)} samples, expected {group_size}",
            sample=f"group {key}",
        ), "incomplete"
    for i, s in enumerate(members):
        name = s.rid if s.rid is not None else f"group {key}[{i}]"
        problem = sample_problem(s, name, check_logprobs=check_logprobs)
        if problem is not None:
            return problem, "invalid"
    prompt = members[0].prompt_ids
    for i, s in enumerate(members[1:], start=1):
        if not torch.equal(s.prompt_ids, prompt):
            return GroupError(
                "prompt_ids",
                f"sample {i} of group {key} has a different prompt than sample 0",
                sample=f"group {key}",
            ), "prompt_mismatch"
    if expected is not None:
        stale = [s.weight_version for s in members if s.weight_version != expected]
        if stale:
            return StaleRolloutError(
                "weight_version",
                f"{len(stale)} sample(s) of group {key} generated by weight version(s) "
                f"{sorted({str(v) for v in stale})}, the trainer expects {expected!r}",
                sample=f"group {key}",
            ), "stale"
    return None, ""
