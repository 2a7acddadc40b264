"""SGLang /generate bodies <-> engine rows.

Every body first passes SGLang's own contract (`GenerateRequest.from_json_value`), so bad
types and unknown `sampling_params` keys get the real server's 400 text. Features the
embedded engine does not implement (streaming, stop strings, penalties, n > 1, top
log-probs, ...) are refused with a 400 naming the field, never silently ignored.

(/update_weights_from_tensor's payload, SGLang's tensor handles, is `weight_sync/tensor_handles.py`.)
"""

from __future__ import annotations

import base64
import math
import os
import uuid
from dataclasses import dataclass, replace
from typing import Any

from megatron_gspo.rollout import contract
from megatron_gspo.rollout.server.engine import GenerationInput, GenerationOutput, SamplingOptions
from megatron_gspo.rollout.server.fields import (
    INT64_MAX,
    RequestError,
    check_bool,
    check_float,
    check_int,
    check_object,
    check_str,
    per_row,
    show,
)

# Sampling parameters the engine does not implement -> the value that means "off".
_UNSUPPORTED_SAMPLING = {
    "stop": (None, "", []),
    "stop_regex": (None, "", []),
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "min_new_tokens": (0,),
    "n": (1,),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": ({},),
    "custom_params": (None,),
    "beam_width": (None, 0, 1),
    "watermark": (None,),
    "choice": ([],),
}
# SGLang 0.5.23's SamplingParams fields, in its order (a test keeps this equal to the wheel's):
# without the wheel an unknown key still gets the contract's 400 text.
SGLANG_SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)  # fmt: skip
# Fields checked by type and range before use (`server.fields`), each 400 naming the field.
_REQUEST_FLAGS = (
    "stream",
    "return_text_in_logprobs",
    "return_routed_experts",
    "return_prompt_token_ids",
    "require_reasoning",
)
_ROW_FLAGS = ("return_logprob", "return_hidden_states", "return_sampling_mask")  # one, or one per row
_SAMPLING_FLAGS = {
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
}
_SAMPLING_INTS = {  # int64 -> (lowest value, default)
    "max_new_tokens": (0, 128),
    "top_k": (-1, -1),
    "min_new_tokens": (0, 0),
    "n": (1, 1),
    "sampling_seed": (0, None),
    "stream_interval": (1, None),
    "beam_width": (0, None),
}
# Finite numbers in SGLang's SamplingParams.verify ranges -> (low, high, low excluded, default).
_SAMPLING_FLOATS = {
    "temperature": (0.0, math.inf, False, 1.0),
    "top_p": (0.0, 1.0, True, 1.0),
    "min_p": (0.0, 1.0, False, 0.0),
    "frequency_penalty": (-2.0, 2.0, False, 0.0),
    "presence_penalty": (-2.0, 2.0, False, 0.0),
    "repetition_penalty": (0.0, 2.0, False, 1.0),
}
_UNSUPPORTED_REQUEST = {
    "stream": (None, False),
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None,),
    "return_hidden_states": (None, False),
    "image_data": (None,),
    "video_data": (None,),
    "audio_data": (None,),
    "lora_path": (None,),
    "custom_logit_processor": (None,),
    "session_params": (None,),
    "return_sampling_mask": (None, False),
}


@dataclass
class ParsedGenerate:
    """A /generate body split into rows."""

    rows: list[GenerationInput]
    rids: list[str]
    return_logprob: list[bool]
    skip_special_tokens: list[bool]
    no_stop_trim: list[bool]
    return_text_in_logprobs: bool
    is_batch: bool


def _is_off(value: Any, off_values: tuple) -> bool:
    return any(value == off for off in off_values)


def parse_generate(body: Any, tokenizer) -> ParsedGenerate:
    """Check `body` field by field, then against SGLang's contract; split it into rows.

    Every field the engine reads is checked first by `server.fields` (type, range, NaN), so
    the 400 names the field; SGLang's contract then checks the rest with the real server's text.

    Raises:
        RequestError: a bad field (named), or a valid SGLang request using a feature the
            embedded server lacks.
        JsonContractError: the body violates SGLang's contract elsewhere.
    """
    body = check_object(body)
    flags = {key: check_bool(body.get(key), key, False) for key in _REQUEST_FLAGS}
    prompts, is_batch = _prompts(body, tokenizer)
    n = len(prompts)

    def row_field(key: str, check) -> list[Any]:
        return per_row(body.get(key), n, key, batch=is_batch, check=check)

    row_flags = {key: row_field(key, lambda v, name: check_bool(v, name, False)) for key in _ROW_FLAGS}
    start = row_field("logprob_start_len", lambda v, name: -1 if v is None else check_int(v, name, -1))
    row_field("top_logprobs_num", lambda v, name: None if v is None else check_int(v, name))
    rids = row_field("rid", lambda v, name: None if v is None else check_str(v, name))
    routed_start = body.get("routed_experts_start_len")
    routed_start = 0 if routed_start is None else check_int(routed_start, "routed_experts_start_len")
    sampling = row_field("sampling_params", _sampling_parser())
    api = contract.load()
    if api is not None:
        api.GenerateRequest.from_json_value(body)  # SGLang's own 400 for anything not checked above
    for key, off in _UNSUPPORTED_REQUEST.items():
        if not _is_off(body.get(key), off):
            raise RequestError(f"{key}={show(body.get(key))} is not supported by the embedded rollout server")
    base = uuid.uuid4().hex
    rids = [r if r is not None else (f"{base}-{i}" if is_batch else base) for i, r in enumerate(rids)]
    rows = [
        GenerationInput(
            input_ids=prompts[i],
            sampling=sampling[i][0],
            logprob_start_len=start[i] if row_flags["return_logprob"][i] else -1,
            return_routed_experts=flags["return_routed_experts"],
            routed_experts_start_len=routed_start,
        )
        for i in range(n)
    ]
    return ParsedGenerate(
        rows=rows,
        rids=rids,
        return_logprob=row_flags["return_logprob"],
        skip_special_tokens=[s[1]["skip_special_tokens"] for s in sampling],
        no_stop_trim=[s[1]["no_stop_trim"] for s in sampling],
        return_text_in_logprobs=flags["return_text_in_logprobs"],
        is_batch=is_batch,
    )


def _prompts(body: dict, tokenizer) -> tuple[list[list[int]], bool]:
    """Token ids of each input row, and whether the request is a batch."""
    input_ids, text = body.get("input_ids"), body.get("text")
    if (input_ids is None) == (text is None):
        raise RequestError("Either text or input_ids should be provided (exactly one).")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError(
                f"input_ids must be a non-empty list of token ids (or of such lists), got {show(input_ids)}"
            )
        is_batch = isinstance(input_ids[0], list)
        rows = input_ids if is_batch else [input_ids]
        for i, row in enumerate(rows):
            _check_token_ids(row, f"input_ids[{i}]" if is_batch else "input_ids")
        return [list(row) for row in rows], is_batch
    is_batch = isinstance(text, list)
    texts = text if is_batch else [text]
    if not texts:
        raise RequestError("text is an empty batch")
    prompts = []
    for i, item in enumerate(texts):
        name = f"text[{i}]" if is_batch else "text"
        check_str(item, name)
        try:
            prompts.append(tokenizer.encode(item))
        except Exception as exc:  # tokenizers raises bare Exception / TypeError
            raise RequestError(f"{name} cannot be tokenized: {exc}") from None
    return prompts, is_batch


def _check_token_ids(row: Any, name: str) -> None:
    if not isinstance(row, list) or not row:
        raise RequestError(f"{name} must be a non-empty list of token ids, got {show(row)}")
    if all(type(t) is int for t in row) and 0 <= min(row) and max(row) <= INT64_MAX:
        return  # the common case, without a Python-level check per token
    for j, token in enumerate(row):
        check_int(token, f"{name}[{j}]")


def _sampling_parser():
    """`_sampling_options` for the rows of one request, each distinct object checked once.

    A batch's rows usually differ only in `sampling_seed`: a row equal to an earlier one in
    every other key (same values of the same types) reuses its checked options with its own
    seed, which is checked as `_sampling_options` checks it.
    """
    seen: dict[tuple, tuple[SamplingOptions, dict[str, Any]]] = {}

    def parse(value: Any, name: str) -> tuple[SamplingOptions, dict[str, Any]]:
        sp = {} if value is None else value
        key = _reuse_key(sp)
        if key not in seen:
            parsed = _sampling_options(sp, name)
            if key is not None:
                seen[key] = parsed
            return parsed
        options, values = seen[key]
        seed = sp.get("sampling_seed")
        low, _ = _SAMPLING_INTS["sampling_seed"]
        seed = None if seed is None else check_int(seed, f"{name}.sampling_seed", low)
        return replace(options, sampling_seed=seed), {**values, "sampling_seed": seed}

    return parse


def _reuse_key(sp: Any) -> tuple | None:
    """`sp` without its seed, as a hashable key with each value's type; None when not hashable."""
    if not isinstance(sp, dict):
        return None
    key = tuple(sorted((k, type(v), v) for k, v in sp.items() if k != "sampling_seed"))
    try:
        hash(key)
    except TypeError:  # a list or object value: checked row by row
        return None
    return key


def _sampling_options(sp: Any, name: str) -> tuple[SamplingOptions, dict[str, bool]]:
    """The engine's options and the response flags of one `sampling_params` object."""
    sp = check_object(sp, name)
    unknown = [key for key in sp if key not in SGLANG_SAMPLING_KEYS]
    if unknown:  # SGLang's contract text, also without the wheel
        expected = ", ".join(f"`{key}`" for key in SGLANG_SAMPLING_KEYS)
        raise RequestError(f"{name}: unknown field `{unknown[0]}`, expected one of {expected}")
    if sp.get("max_new_tokens", 128) is None:
        raise RequestError(f"{name}.max_new_tokens=null (generate to the context length) is not supported")
    values: dict[str, Any] = {
        key: check_bool(sp.get(key), f"{name}.{key}", d) for key, d in _SAMPLING_FLAGS.items()
    }
    for key, (low, default) in _SAMPLING_INTS.items():
        value = sp.get(key)
        values[key] = default if value is None else check_int(value, f"{name}.{key}", low)
    for key, (low, high, low_open, default) in _SAMPLING_FLOATS.items():
        value = sp.get(key)
        values[key] = (
            default if value is None else check_float(value, f"{name}.{key}", low, high, low_open=low_open)
        )
    if values["top_k"] == 0:
        raise RequestError(f"{name}.top_k must be -1 (disable), or at least 1, got 0.")
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise RequestError(f"{name}.stop_token_ids must be a list of token ids, got {show(stop_ids)}")
    stop_ids = [check_int(t, f"{name}.stop_token_ids[{i}]") for i, t in enumerate(stop_ids)]
    for key, off in _UNSUPPORTED_SAMPLING.items():
        value = values.get(key, sp.get(key, off[0]))
        if not _is_off(value, off):
            raise RequestError(f"{name}.{key}={show(value)} is not supported by the embedded rollout server")
    options = SamplingOptions(
        max_new_tokens=values["max_new_tokens"],
        temperature=values["temperature"],
        top_p=values["top_p"],
        top_k=values["top_k"],
        min_p=values["min_p"],
        stop_token_ids=tuple(stop_ids),
        ignore_eos=values["ignore_eos"],
        sampling_seed=values["sampling_seed"],
    )
    return options, values


FORCE_STREAM_INTERVAL_ENV = "SGLANG_FORCE_STREAM_INTERVAL"
"""SGLang's env var (default 50): a non-streamed request's tokens reach its tokenizer manager every
that many tokens, so a request aborted in the waiting queue returns only those (`build_response`)."""


def force_stream_interval() -> int:
    """SGLang's `SGLANG_FORCE_STREAM_INTERVAL` (50 unless set), read as SGLang reads it."""
    return int(os.environ.get(FORCE_STREAM_INTERVAL_ENV, "50"))


def weight_version_spans(
    events: list[tuple[str, int]], current: str, total: int, visible: int
) -> list[dict[str, Any]]:
    """SGLang's `meta_info.weight_versions` of a response.

    `compute_weight_version_spans` (srt/utils/weight_versions.py) over the row's events
    `(old version, output tokens then)` and the version at its end, for `total` tokens, then
    `add_weight_versions_to_meta_info`'s cut to the `visible` tokens the response returns.
    """
    spans: list[dict[str, Any]] = []
    for version, end in [*events, (current, total)]:
        end = min(end, total)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return [
        {**span, "end": min(span["end"], visible)}
        for span in spans
        if span["start"] < visible or span["start"] == 0
    ]


def build_response(
    parsed: ParsedGenerate, i: int, out: GenerationOutput, tokenizer, e2e_latency: float
) -> dict[str, Any]:
    """SGLang's `{"text", "output_ids", "meta_info"}` for row `i`.

    A row aborted in the waiting queue (`out.aborted_waiting`) is answered as SGLang's
    `TokenizerManager._handle_abort_req` answers it: only the tokens streamed to the tokenizer
    manager (a multiple of `force_stream_interval()`), their log-probs, no routed experts and no
    prompt/cached token counts.
    """
    row = parsed.rows[i]
    ids = out.output_ids
    logprobs = out.output_logprobs
    if out.aborted_waiting:
        streamed = len(ids) - len(ids) % force_stream_interval()
        ids, logprobs = ids[:streamed], logprobs[:streamed]
    shown = (
        ids[:-1] if out.finish_reason.get("type") == "stop" and not parsed.no_stop_trim[i] and ids else ids
    )
    spans = weight_version_spans(out.weight_version_events, out.weight_version, len(out.output_ids), len(ids))
    if out.aborted_waiting:
        meta: dict[str, Any] = {
            "id": parsed.rids[i],
            "finish_reason": out.finish_reason,
            "weight_version": out.weight_version,
            "e2e_latency": e2e_latency,
        }
    else:
        meta = {
            "id": parsed.rids[i],
            "prompt_tokens": len(row.input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "finish_reason": out.finish_reason,
            "weight_version": out.weight_version,
            "e2e_latency": e2e_latency,
        }
    meta["weight_versions"] = spans
    meta["weight_version"] = spans[-1]["version"]  # SGLang: the last visible span's
    if parsed.return_logprob[i]:

        def text_of(tok: int) -> str | None:
            return tokenizer.decode([tok]) if parsed.return_text_in_logprobs else None

        meta["output_token_logprobs"] = [[lp, t, text_of(t)] for lp, t in zip(logprobs, ids)]
        meta["output_token_logprobs_length"] = len(ids)
        if out.input_logprobs is not None and not (out.aborted_waiting and not ids):
            prompt = row.input_ids[row.logprob_start_len :] if row.logprob_start_len >= 0 else []
            meta["input_token_logprobs"] = [[lp, t, text_of(t)] for lp, t in zip(out.input_logprobs, prompt)]
        elif out.aborted_waiting:
            meta["input_token_logprobs"] = []  # nothing streamed yet
    if out.aborted_waiting:
        meta["completion_tokens"] = len(ids)
    elif row.return_routed_experts and out.routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(out.routed_experts)
    text = tokenizer.decode(shown, skip_special_tokens=parsed.skip_special_tokens[i])
    return {"text": text, "output_ids": ids, "meta_info": meta}


def encode_routed_experts(routed) -> str:
    """SGLang's encoding: base64 of little-endian int32 [rows, num_layers, topk]."""
    return base64.b64encode(routed.astype("<i4", copy=False).tobytes()).decode("ascii")


def check_response(response: dict[str, Any]) -> None:
    """Raise JsonContractError if `response` violates SGLang's `GenerateResponse` contract."""
    api = contract.load()
    if api is not None:
        api.GenerateResponse.from_json_value(response)
