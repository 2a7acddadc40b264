"""SGLang /generate bodies <-> engine rows, and the tensor serializer of /update_weights_from_tensor.

Every body first passes SGLang's own contract (`GenerateRequest.from_json_value`), so bad
types and unknown `sampling_params` keys get the real server's 400 text. Features the
embedded engine does not implement (streaming, stop strings, penalties, n > 1, top
log-probs, ...) are refused with a 400 naming the field, never silently ignored.

Tensor updates: real SGLang's `serialized_named_tensors` holds, per TP rank, base64 of its
`MultiprocessingSerializer` pickle (CUDA IPC handles, meaningful only on the same GPU host).
The embedded server instead takes base64 of a safetensors blob (`serialize_named_tensors`),
which carries the tensor data itself and works across processes on CPU.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from megatron_gspo.rollout import contract
from megatron_gspo.rollout.engine import GenerationInput, GenerationOutput, SamplingOptions

TENSOR_LOAD_FORMAT = "safetensors_base64"
"""`load_format` naming the embedded server's tensor serialization (None is accepted as the same)."""

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


class RequestError(ValueError):
    """A request the embedded server refuses (HTTP 400)."""


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


def _per_row(value: Any, n: int, name: str, *, batch: bool) -> list[Any]:
    if batch and isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {n} inputs")
        return list(value)
    if isinstance(value, list):
        raise RequestError(f"{name} is a list but the request has a single input")
    return [value] * n


def _is_off(value: Any, off_values: tuple) -> bool:
    return any(value == off for off in off_values)


def parse_generate(body: Any, tokenizer) -> ParsedGenerate:
    """Check `body` against SGLang's contract and the engine's abilities; split it into rows.

    Raises:
        JsonContractError: the body violates SGLang's contract (the real server's 400 text).
        RequestError: a valid SGLang request using a feature the embedded server lacks.
    """
    api = contract.load()
    req = api.GenerateRequest.from_json_value(body) if api is not None else None
    get = (lambda k, d=None: getattr(req, k)) if req is not None else (lambda k, d=None: body.get(k, d))
    for key, off in _UNSUPPORTED_REQUEST.items():
        if not _is_off(get(key), off):
            raise RequestError(f"{key}={get(key)!r} is not supported by the embedded rollout server")
    input_ids, text = get("input_ids"), get("text")
    if (input_ids is None) == (text is None):
        raise RequestError("Either text or input_ids should be provided (exactly one).")
    if input_ids is not None:
        is_batch = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = [list(x) for x in input_ids] if is_batch else [list(input_ids)]
    else:
        is_batch = isinstance(text, list)
        prompts = [tokenizer.encode(t) for t in (text if is_batch else [text])]
    n = len(prompts)
    if n == 0:
        raise RequestError("input_ids is an empty batch")
    sampling = _per_row(get("sampling_params") or {}, n, "sampling_params", batch=is_batch)
    return_logprob = _per_row(get("return_logprob") or False, n, "return_logprob", batch=is_batch)
    start = _per_row(get("logprob_start_len"), n, "logprob_start_len", batch=is_batch)
    rid = get("rid")
    rids = _per_row(rid, n, "rid", batch=is_batch) if rid is not None else [None] * n
    base = uuid.uuid4().hex
    rids = [r if r is not None else (f"{base}-{i}" if is_batch else base) for i, r in enumerate(rids)]
    routed = bool(body.get("return_routed_experts", False))
    routed_start = get("routed_experts_start_len", 0) or 0
    rows, skip, no_trim = [], [], []
    for i in range(n):
        options, flags = _sampling_options(sampling[i])
        skip.append(flags[0])
        no_trim.append(flags[1])
        want_lp = bool(return_logprob[i])
        rows.append(
            GenerationInput(
                input_ids=prompts[i],
                sampling=options,
                logprob_start_len=(start[i] if start[i] is not None else -1) if want_lp else -1,
                return_routed_experts=routed,
                routed_experts_start_len=int(routed_start),
            )
        )
    return ParsedGenerate(
        rows=rows,
        rids=rids,
        return_logprob=[bool(x) for x in return_logprob],
        skip_special_tokens=skip,
        no_stop_trim=no_trim,
        return_text_in_logprobs=bool(get("return_text_in_logprobs")),
        is_batch=is_batch,
    )


def _sampling_options(sp: Any) -> tuple[SamplingOptions, tuple[bool, bool]]:
    if isinstance(sp, dict):  # not checked by SGLang's contract types (the wheel is absent)
        unknown = [key for key in sp if key not in SGLANG_SAMPLING_KEYS]
        if unknown:
            expected = ", ".join(f"`{key}`" for key in SGLANG_SAMPLING_KEYS)
            raise RequestError(f"unknown field `{unknown[0]}`, expected one of {expected}")
    get = (lambda k, d: sp.get(k, d)) if isinstance(sp, dict) else (lambda k, d: getattr(sp, k))
    for key, off in _UNSUPPORTED_SAMPLING.items():
        value = get(key, off[0])
        if not _is_off(value, off):
            raise RequestError(
                f"sampling_params.{key}={value!r} is not supported by the embedded rollout server"
            )
    max_new = get("max_new_tokens", 128)
    temperature = get("temperature", 1.0)
    top_p, top_k, min_p = get("top_p", 1.0), get("top_k", -1), get("min_p", 0.0)
    if max_new is None or max_new < 0:
        raise RequestError(f"sampling_params.max_new_tokens must be >= 0, got {max_new}")
    if temperature is None or temperature < 0:
        raise RequestError(f"sampling_params.temperature must be non-negative, got {temperature}")
    if top_p is None or not 0.0 < top_p <= 1.0:
        raise RequestError(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    if top_k is None or (top_k < 1 and top_k != -1):
        raise RequestError(f"sampling_params.top_k must be -1 (disable), or at least 1, got {top_k}.")
    if min_p is None or not 0.0 <= min_p <= 1.0:
        raise RequestError(f"sampling_params.min_p must be in [0, 1], got {min_p}")
    options = SamplingOptions(
        max_new_tokens=int(max_new),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        min_p=float(min_p),
        stop_token_ids=tuple(int(t) for t in (get("stop_token_ids", None) or ())),
        ignore_eos=bool(get("ignore_eos", False)),
        sampling_seed=get("sampling_seed", None),
    )
    flags = (bool(get("skip_special_tokens", True)), bool(get("no_stop_trim", False)))
    return options, flags


def build_response(
    parsed: ParsedGenerate, i: int, out: GenerationOutput, tokenizer, e2e_latency: float
) -> dict[str, Any]:
    """SGLang's `{"text", "output_ids", "meta_info"}` for row `i`."""
    row = parsed.rows[i]
    ids = out.output_ids
    shown = (
        ids[:-1] if out.finish_reason.get("type") == "stop" and not parsed.no_stop_trim[i] and ids else ids
    )
    meta: dict[str, Any] = {
        "id": parsed.rids[i],
        "prompt_tokens": len(row.input_ids),
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "finish_reason": out.finish_reason,
        "weight_version": out.weight_version,
        "e2e_latency": e2e_latency,
    }
    if parsed.return_logprob[i]:

        def text_of(tok: int) -> str | None:
            return tokenizer.decode([tok]) if parsed.return_text_in_logprobs else None

        meta["output_token_logprobs"] = [[lp, t, text_of(t)] for lp, t in zip(out.output_logprobs, ids)]
        meta["output_token_logprobs_length"] = len(ids)
        if out.input_logprobs is not None:
            prompt = row.input_ids[row.logprob_start_len :] if row.logprob_start_len >= 0 else []
            meta["input_token_logprobs"] = [[lp, t, text_of(t)] for lp, t in zip(out.input_logprobs, prompt)]
    if row.return_routed_experts and out.routed_experts is not None:
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


def serialize_named_tensors(named_tensors: dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]]) -> str:
    """Base64 of a safetensors blob of `named_tensors`: the embedded server's `serialized_named_tensors`."""
    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    blob = safetensors_save({name: t.detach().to("cpu").contiguous() for name, t in items})
    return base64.b64encode(blob).decode("ascii")


def deserialize_named_tensors(payload: str | list[str]) -> dict[str, torch.Tensor]:
    """Inverse of `serialize_named_tensors`; a list (SGLang: one entry per TP rank) must have one entry."""
    if isinstance(payload, list):
        if len(payload) != 1:
            raise RequestError(
                f"serialized_named_tensors has {len(payload)} entries; the embedded server has one rank"
            )
        payload = payload[0]
    if not isinstance(payload, str):
        raise RequestError("serialized_named_tensors must be a base64 string (or a one-element list of them)")
    try:
        return safetensors_load(base64.b64decode(payload, validate=True))
    except Exception as exc:  # safetensors raises its own error types
        raise RequestError(f"serialized_named_tensors is not base64 safetensors data: {exc}") from exc
