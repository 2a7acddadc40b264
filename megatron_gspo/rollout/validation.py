"""Turn one SGLang ``/generate`` response into a validated `RolloutSample`, or say what is wrong.

Everything a trainer could silently get wrong from a rollout is checked here, once: the
generated token ids (``output_ids``) against the ids inside ``meta_info.output_token_logprobs``,
one finite, non-positive log-prob per generated token, vocabulary bounds, the prompt length the
server saw (``prompt_tokens``) against the prompt we sent, the finish reason, the weight version,
and the routed experts' base64 payload (size, range, distinct top-k).

Conventions:

- Log-probs are SGLang's ``output_token_logprobs[i][0]``: the log-probability of generated
  token ``i`` under the sampling policy (pi_old). A value in ``(0, logprob_tolerance]`` is float
  rounding of a log-prob of ~0 (probability ~1) and is clamped to 0.0; anything larger is an
  error, as is NaN/inf/null.
- Routed experts: base64 of little-endian int32 of shape ``[P + R - 1 - start, L, k]`` where
  ``P``/``R`` are the prompt/response lengths, ``L`` the MoE layers and ``k`` the experts per
  token; row ``j`` is the routing of the token at position ``start + j`` (the last generated
  token is never run through the model). The request built by `build_generate_request` sets
  ``routed_experts_start_len=0``, so ``start`` is assumed 0 here: rows cover positions
  ``[0, P + R - 1)``. The decoded array is stored compactly: uint8 when ``num_experts <= 256``,
  else int16.
"""

from __future__ import annotations

import binascii
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pybase64
import torch

from megatron_gspo.rollout.errors import (
    EmptyResponseError,
    FinishReasonError,
    InvalidLogprobError,
    LengthMismatchError,
    MalformedResponseError,
    RoutedExpertsError,
    TokenIdError,
    WeightVersionError,
)
from megatron_gspo.rollout.types import RolloutSample, Segment

DEFAULT_LOGPROB_TOLERANCE = 1e-6
"""Largest positive log-prob accepted as rounding (then clamped to 0.0)."""

_FINISH_TYPES = ("stop", "length", "abort")


def routed_experts_dtype(num_experts: int) -> torch.dtype:
    """The compact integer dtype that holds expert ids ``[0, num_experts)``: uint8 or int16."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(f"num_experts={num_experts} does not fit int16 expert ids")


def parse_generate_response(
    input_ids: Sequence[int],
    response: Mapping[str, Any] | bytes | str,
    *,
    vocab_size: int | None = None,
    num_layers: int | None = None,
    topk: int | None = None,
    num_experts: int | None = None,
    expect_routed_experts: bool = False,
    rid: str | None = None,
    logprob_tolerance: float = DEFAULT_LOGPROB_TOLERANCE,
    allow_mixed_versions: bool = False,
) -> RolloutSample:
    """Validate one non-streaming ``/generate`` response and return it as a `RolloutSample`.

    Args:
        input_ids: the prompt token ids sent in the request, length ``P``.
        response: the response body: a parsed dict, or the raw JSON (bytes or str).
        vocab_size: when given, every token id must lie in ``[0, vocab_size)``.
        num_layers: MoE layers ``L`` (needed to decode routed experts).
        topk: experts per token ``k`` (needed to decode routed experts).
        num_experts: experts per layer ``E`` (needed to decode routed experts; ids must lie in
            ``[0, E)``; picks the compact dtype).
        expect_routed_experts: the request asked for routed experts, so they must be present.
        rid: the request id sent; when given, ``meta_info.id`` must match it.
        logprob_tolerance: positive log-probs up to this are rounding, clamped to 0.0.
        allow_mixed_versions: accept a response whose ``meta_info.weight_versions`` spans name
            several versions (a weight update landed while it was held by a pause); each token's
            log-prob is then that of the version that generated it. Off, such a response is
            refused (one batch, one policy).

    Returns:
        A sample with ``prompt_ids [P]`` int64, ``response_ids [R]`` int64,
        ``rollout_logprobs [R]`` float32 and ``routed_experts [P + R - 1, L, k]`` uint8/int16
        (or None when the response carries none); ``segments`` are SGLang's
        ``meta_info.weight_versions`` spans when the server reported them, which must tile the
        response (None when it reported none).

    Raises:
        RolloutValidationError: a subclass naming the field and what was wrong with it.
        ValueError: routed experts are present but ``num_layers``/``topk``/``num_experts`` were
            not given (a caller error, not a bad response).
    """
    sample_name = rid
    prompt = _check_prompt(input_ids, vocab_size, sample_name)
    body = _decode_body(response, sample_name)
    meta = body.get("meta_info")
    if meta is None:
        raise MalformedResponseError("meta_info", "missing", sample=sample_name)
    if not isinstance(meta, dict):
        raise MalformedResponseError(
            "meta_info", f"expected an object, got {type(meta).__name__}", sample=sample_name
        )
    if sample_name is None and isinstance(meta.get("id"), str):
        sample_name = meta["id"]
    elif rid is not None and "id" in meta and meta["id"] != rid:
        raise MalformedResponseError(
            "meta_info.id", f"is {meta['id']!r}, but the request was sent with rid {rid!r}", sample=rid
        )

    output_ids = _int_list(body.get("output_ids"), "output_ids", sample_name)
    logprobs, logprob_token_ids = _logprob_entries(meta, sample_name, logprob_tolerance)
    if not output_ids and not logprobs:
        raise EmptyResponseError("output_ids", "no token was generated", sample=sample_name)
    if len(logprobs) != len(output_ids):
        raise LengthMismatchError(
            "meta_info.output_token_logprobs",
            f"{len(logprobs)} log-probs for {len(output_ids)} generated tokens in output_ids",
            sample=sample_name,
        )
    declared = meta.get("output_token_logprobs_length")
    if declared is not None and declared != len(logprobs):
        raise LengthMismatchError(
            "meta_info.output_token_logprobs_length",
            f"says {declared} but output_token_logprobs holds {len(logprobs)} entries",
            sample=sample_name,
        )
    if output_ids != logprob_token_ids:  # list equality runs in C; the walk only names the token
        i = next(i for i, (a, b) in enumerate(zip(output_ids, logprob_token_ids)) if a != b)
        raise TokenIdError(
            f"output_ids[{i}]",
            f"token {output_ids[i]} disagrees with token {logprob_token_ids[i]} in "
            f"meta_info.output_token_logprobs[{i}]",
            sample=sample_name,
        )
    _check_token_range(output_ids, "output_ids", vocab_size, sample_name)
    _check_counts(meta, len(prompt), len(output_ids), sample_name)
    finish_reason = _finish_reason(meta.get("finish_reason"), sample_name)
    weight_version = _weight_version(meta, sample_name, allow_mixed_versions)
    segments = _version_segments(meta, len(output_ids), sample_name)

    routed = meta.get("routed_experts")
    if routed is None and expect_routed_experts:
        raise RoutedExpertsError(
            "meta_info.routed_experts",
            "missing although the request asked for routed experts "
            "(is the server started with --enable-return-routed-experts?)",
            sample=sample_name,
        )
    routed_experts = None
    if routed is not None:
        routed_experts = decode_routed_experts(
            routed,
            num_tokens=len(prompt) + len(output_ids),
            num_layers=num_layers,
            topk=topk,
            num_experts=num_experts,
            sample=sample_name,
        )
    return RolloutSample(
        prompt_ids=torch.tensor(prompt, dtype=torch.int64),
        response_ids=torch.tensor(output_ids, dtype=torch.int64),
        rollout_logprobs=torch.tensor(logprobs, dtype=torch.float32),
        finish_reason=finish_reason,
        weight_version=weight_version,
        routed_experts=routed_experts,
        rid=sample_name,
        segments=segments,
    )


def decode_routed_experts(
    payload: Any,
    *,
    num_tokens: int,
    num_layers: int | None,
    topk: int | None,
    num_experts: int | None,
    sample: str | int | None = None,
) -> torch.Tensor:
    """Decode SGLang's base64 int32-LE routed experts into ``[num_tokens - 1, L, k]``.

    Args:
        payload: the ``meta_info.routed_experts`` value (a base64 string).
        num_tokens: prompt + response length ``T``.
        num_layers: MoE layers ``L``.
        topk: experts per token ``k``.
        num_experts: experts per layer ``E``.
        sample: the sample's name for error messages.

    Returns:
        Expert ids ``[T - 1, L, k]`` in uint8 (``E <= 256``) or int16.
    """
    if num_layers is None or topk is None or num_experts is None:
        raise ValueError(
            "the response carries routed experts; pass num_layers, topk and num_experts to decode them"
        )
    field = "meta_info.routed_experts"
    if not isinstance(payload, str):
        raise RoutedExpertsError(
            field, f"expected a base64 string, got {type(payload).__name__}", sample=sample
        )
    try:
        raw = pybase64.b64decode(payload, validate=True)  # SIMD: ~30x the stdlib on 1.5 KB per token
    except (binascii.Error, ValueError) as err:
        raise RoutedExpertsError(field, f"not valid base64 ({err})", sample=sample) from None
    rows = num_tokens - 1
    expected = rows * num_layers * topk * 4
    if len(raw) != expected:
        raise RoutedExpertsError(
            field,
            f"decodes to {len(raw)} bytes, expected {expected} = (prompt+completion-1={rows}) x "
            f"layers={num_layers} x topk={topk} x 4 (int32)",
            sample=sample,
        )
    ids = np.frombuffer(raw, dtype="<i4").reshape(rows, num_layers, topk)
    if ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= num_experts:
            bad = low if low < 0 else high
            raise RoutedExpertsError(field, f"expert id {bad} outside [0, {num_experts})", sample=sample)
        small = ids.astype(np.uint8 if num_experts <= 256 else np.int16)  # ids are in range now
        repeats = np.zeros(small.shape[:-1], dtype=bool)  # [T-1, L]; k(k-1)/2 compares beat a sort
        for a in range(topk):
            for b in range(a + 1, topk):
                repeats |= small[..., a] == small[..., b]
        if repeats.any():
            token, layer = np.argwhere(repeats)[0]
            raise RoutedExpertsError(
                field,
                f"a token's top-{topk} experts repeat (position {token}, layer {layer}: "
                f"{ids[token, layer].tolist()})",
                sample=sample,
            )
    compact = np.uint8 if routed_experts_dtype(num_experts) == torch.uint8 else np.int16
    return torch.from_numpy(ids.astype(compact))


def _decode_body(response: Mapping[str, Any] | bytes | str, sample: str | None) -> dict:
    if isinstance(response, bytes | bytearray | str):
        try:
            response = json.loads(response)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise MalformedResponseError("response", f"not valid JSON ({err})", sample=sample) from None
    if not isinstance(response, Mapping):
        raise MalformedResponseError(
            "response", f"expected a JSON object, got {type(response).__name__}", sample=sample
        )
    if "error" in response and "meta_info" not in response:
        raise MalformedResponseError(
            "error", f"the server returned an error: {response['error']}", sample=sample
        )
    return dict(response)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(value: Any, field: str, sample: str | None) -> list[int]:
    if value is None:
        raise MalformedResponseError(field, "missing", sample=sample)
    if not isinstance(value, list | tuple):
        raise MalformedResponseError(
            field, f"expected a list of token ids, got {type(value).__name__}", sample=sample
        )
    if not set(map(type, value)) <= {int}:  # one C-level pass; bool is not int here
        for i, token in enumerate(value):  # only to name the first offender
            if not _is_int(token):
                raise MalformedResponseError(
                    f"{field}[{i}]", f"expected an integer token id, got {token!r}", sample=sample
                )
    return list(value)


def _check_prompt(input_ids: Sequence[int], vocab_size: int | None, sample: str | None) -> list[int]:
    if isinstance(input_ids, torch.Tensor | np.ndarray):
        input_ids = input_ids.tolist()
    prompt = _int_list(input_ids, "input_ids", sample)
    if not prompt:
        raise EmptyResponseError("input_ids", "the prompt is empty", sample=sample)
    _check_token_range(prompt, "input_ids", vocab_size, sample)
    return prompt


def _check_token_range(ids: list[int], field: str, vocab_size: int | None, sample: str | None) -> None:
    limit = np.iinfo(np.int64).max if vocab_size is None else vocab_size
    if not ids or (0 <= min(ids) and max(ids) < limit):  # min/max run in C: the common case
        return
    for i, token in enumerate(ids):  # only to name the first offender
        if token < 0:
            raise TokenIdError(f"{field}[{i}]", f"negative token id {token}", sample=sample)
        if vocab_size is not None and token >= vocab_size:
            raise TokenIdError(
                f"{field}[{i}]", f"token id {token} outside the vocabulary [0, {vocab_size})", sample=sample
            )


def _logprob_entries(meta: dict, sample: str | None, tolerance: float) -> tuple[list[float], list[int]]:
    """``meta_info.output_token_logprobs``: ``[[logprob, token_id, text|null], ...]``."""
    field = "meta_info.output_token_logprobs"
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise MalformedResponseError(
            field, "missing (was the request sent with return_logprob=true?)", sample=sample
        )
    if not isinstance(entries, list | tuple):
        raise MalformedResponseError(field, f"expected a list, got {type(entries).__name__}", sample=sample)
    fast = _logprob_entries_fast(entries, tolerance)
    if fast is not None:
        return fast
    logprobs, token_ids = [], []  # a bad entry somewhere: walk the entries to name the first one
    for i, entry in enumerate(entries):
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise MalformedResponseError(
                f"{field}[{i}]", f"expected [logprob, token_id, text], got {entry!r}", sample=sample
            )
        value, token, text = entry
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidLogprobError(f"{field}[{i}][0]", f"expected a number, got {value!r}", sample=sample)
        value = float(value)
        if not math.isfinite(value):
            raise InvalidLogprobError(f"{field}[{i}][0]", f"non-finite log-prob {value}", sample=sample)
        if value > tolerance:
            raise InvalidLogprobError(
                f"{field}[{i}][0]",
                f"positive log-prob {value} (> tolerance {tolerance}); a probability cannot exceed 1",
                sample=sample,
            )
        if not _is_int(token):
            raise MalformedResponseError(
                f"{field}[{i}][1]", f"expected an integer token id, got {token!r}", sample=sample
            )
        if text is not None and not isinstance(text, str):
            raise MalformedResponseError(
                f"{field}[{i}][2]", f"expected a string or null, got {type(text).__name__}", sample=sample
            )
        logprobs.append(min(value, 0.0))
        token_ids.append(token)
    return logprobs, token_ids


def _logprob_entries_fast(entries: Sequence, tolerance: float) -> tuple[list[float], list[int]] | None:
    """Whole-array checks of well-formed entries (None when any entry needs the named-error walk)."""
    if not entries:
        return [], []
    if not set(map(type, entries)) <= {list, tuple} or set(map(len, entries)) != {3}:
        return None
    values, tokens, texts = zip(*entries)
    if not set(map(type, values)) <= {float, int} or not set(map(type, tokens)) <= {int}:
        return None
    if not set(map(type, texts)) <= {str, type(None)}:
        return None
    try:
        array = np.asarray(values, dtype=np.float64)
    except OverflowError:  # an int beyond float range: the walk names it
        return None
    if not np.isfinite(array).all() or (array > tolerance).any():
        return None
    return np.minimum(array, 0.0).tolist(), list(tokens)


def _check_counts(meta: dict, prompt_len: int, response_len: int, sample: str | None) -> None:
    for key, actual, what in (
        ("prompt_tokens", prompt_len, "prompt tokens sent (len(input_ids))"),
        ("completion_tokens", response_len, "generated tokens in output_ids"),
    ):
        value = meta.get(key)
        if value is None:
            raise MalformedResponseError(f"meta_info.{key}", "missing", sample=sample)
        if not _is_int(value) or value < 0:
            raise MalformedResponseError(
                f"meta_info.{key}", f"expected a non-negative integer, got {value!r}", sample=sample
            )
        if value != actual:
            raise LengthMismatchError(
                f"meta_info.{key}", f"is {value}, but there are {actual} {what}", sample=sample
            )


def _finish_reason(value: Any, sample: str | None) -> str:
    """``{"type": "length", "length": N}`` / ``{"type": "stop", "matched": ...}``; abort is an error."""
    field = "meta_info.finish_reason"
    if value is None:
        raise FinishReasonError(field, "missing (the generation did not finish)", sample=sample)
    if not isinstance(value, dict):
        raise FinishReasonError(field, f"expected an object, got {value!r}", sample=sample)
    kind = value.get("type")
    if kind not in _FINISH_TYPES:
        raise FinishReasonError(
            f"{field}.type", f"expected one of {_FINISH_TYPES}, got {kind!r}", sample=sample
        )
    if kind == "abort":
        raise FinishReasonError(
            field, f"the generation was aborted: {value.get('message') or 'no message'}", sample=sample
        )
    if kind == "length":
        length = value.get("length")
        if length is not None and (not _is_int(length) or length < 0):
            raise FinishReasonError(
                f"{field}.length", f"expected a non-negative integer, got {length!r}", sample=sample
            )
    else:
        matched = value.get("matched")
        ok = (
            matched is None
            or isinstance(matched, str)
            or _is_int(matched)
            or (isinstance(matched, list) and all(_is_int(m) for m in matched))
        )
        if not ok:
            raise FinishReasonError(
                f"{field}.matched",
                f"expected a token id, string or list of ids, got {matched!r}",
                sample=sample,
            )
    return kind


def _version_segments(meta: dict, count: int, sample: str | None) -> list[Segment] | None:
    """SGLang's ``meta_info.weight_versions`` spans as `Segment`s tiling ``count`` tokens (None: absent)."""
    spans = meta.get("weight_versions")
    if not spans:
        return None
    field = "meta_info.weight_versions"
    segments, at = [], 0
    for i, span in enumerate(spans):
        start, end, version = span.get("start"), span.get("end"), span.get("version")
        if not (_is_int(start) and _is_int(end) and isinstance(version, str)):
            raise WeightVersionError(
                f"{field}[{i}]", f"expected {{version, start, end}}, got {span!r}", sample=sample
            )
        if start != at or end < start:
            raise WeightVersionError(
                f"{field}[{i}]", f"spans {start}..{end}, expected one starting at token {at}", sample=sample
            )
        if end > start:
            segments.append(Segment(start, end - start, version))
        at = end
    if at != count:
        raise WeightVersionError(field, f"spans cover {at} tokens, the response has {count}", sample=sample)
    return segments


def _weight_version(meta: dict, sample: str | None, allow_mixed: bool = False) -> str | None:
    version = meta.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise WeightVersionError(
            "meta_info.weight_version", f"expected a string, got {type(version).__name__}", sample=sample
        )
    spans = meta.get("weight_versions")
    if spans:
        if not isinstance(spans, list) or not all(isinstance(s, dict) for s in spans):
            raise WeightVersionError("meta_info.weight_versions", "expected a list of spans", sample=sample)
        versions = sorted({str(s.get("version")) for s in spans})
        if len(versions) > 1 and not allow_mixed:
            raise WeightVersionError(
                "meta_info.weight_versions",
                f"one response was generated by several weight versions {versions}; "
                "its log-probs do not come from one policy",
                sample=sample,
            )
    return version
