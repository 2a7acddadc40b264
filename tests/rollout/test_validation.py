"""parse_generate_response: good SGLang responses decode exactly; each kind of bad one is named."""

from __future__ import annotations

import base64
import copy
import json
import struct

import numpy as np
import pytest
import torch

from megatron_gspo.rollout import contract
from megatron_gspo.rollout.errors import (
    EmptyResponseError,
    FinishReasonError,
    InvalidLogprobError,
    LengthMismatchError,
    MalformedResponseError,
    RolloutValidationError,
    RoutedExpertsError,
    TokenIdError,
    WeightVersionError,
)
from megatron_gspo.rollout.validation import parse_generate_response

PROMPT = [1, 5, 7]
OUTPUT = [9, 4, 2]
LOGPROBS = [-0.25, -1.5, -0.125]  # exact in float32
VOCAB, LAYERS, TOPK, EXPERTS = 16, 2, 2, 8
ROWS = len(PROMPT) + len(OUTPUT) - 1  # routed experts cover positions [0, T-1)
ROUTES = [
    [[(t + layer) % EXPERTS, (t + layer + 3) % EXPERTS] for layer in range(LAYERS)] for t in range(ROWS)
]
LAYOUT = dict(vocab_size=VOCAB, num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)


def encode_routes(routes) -> str:
    """SGLang's encoding, written independently of the decoder: int32 little-endian, base64."""
    flat = [e for row in routes for layer in row for e in layer]
    return base64.b64encode(struct.pack(f"<{len(flat)}i", *flat)).decode()


def good_response(routes=ROUTES) -> dict:
    """A /generate response in SGLang's documented format."""
    meta = {
        "id": "req-0",
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(OUTPUT),
        "cached_tokens": 0,
        "finish_reason": {"type": "length", "length": len(OUTPUT)},
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(LOGPROBS, OUTPUT)],
        "output_token_logprobs_length": len(OUTPUT),
        "weight_version": "3",
        "e2e_latency": 0.01,
    }
    if routes is not None:
        meta["routed_experts"] = encode_routes(routes)
    return {"text": "xyz", "output_ids": list(OUTPUT), "meta_info": meta}


# ---- good responses -------------------------------------------------------------------------


def test_good_response_passes_sglang_contract_and_parses_exactly():
    response = good_response()
    api = contract.require()
    decoded = api.GenerateResponse.from_json_value(response)  # the format is SGLang's own
    assert list(decoded.output_ids) == OUTPUT and decoded.meta_info.weight_version == "3"

    sample = parse_generate_response(PROMPT, response, expect_routed_experts=True, rid="req-0", **LAYOUT)
    assert sample.prompt_ids.dtype == torch.int64 and sample.prompt_ids.tolist() == PROMPT
    assert sample.response_ids.dtype == torch.int64 and sample.response_ids.tolist() == OUTPUT
    assert sample.rollout_logprobs.dtype == torch.float32
    assert sample.rollout_logprobs.tolist() == LOGPROBS
    assert sample.finish_reason == "length"
    assert sample.weight_version == "3"
    assert sample.rid == "req-0"
    assert sample.routed_experts.shape == (ROWS, LAYERS, TOPK)
    assert sample.routed_experts.dtype == torch.uint8
    assert sample.routed_experts.tolist() == ROUTES


def test_routed_experts_decoding_against_hand_written_bytes():
    # T = 3 tokens -> 2 rows, 1 layer, top-2: rows [[1, 0]], [[3, 2]] as int32 LE.
    raw = b"\x01\x00\x00\x00" + b"\x00\x00\x00\x00" + b"\x03\x00\x00\x00" + b"\x02\x00\x00\x00"
    response = {
        "text": "",
        "output_ids": [4],
        "meta_info": {
            "prompt_tokens": 2,
            "completion_tokens": 1,
            "finish_reason": {"type": "stop", "matched": 4},
            "output_token_logprobs": [[-0.5, 4, "a"]],
            "routed_experts": base64.b64encode(raw).decode(),
        },
    }
    sample = parse_generate_response([1, 2], response, num_layers=1, topk=2, num_experts=4)
    assert sample.routed_experts.tolist() == [[[1, 0]], [[3, 2]]]
    assert sample.finish_reason == "stop"
    assert sample.weight_version is None


def test_many_experts_decode_to_int16():
    experts = 300
    routes = [[[299 - t - layer, t + layer] for layer in range(LAYERS)] for t in range(ROWS)]
    sample = parse_generate_response(
        PROMPT, good_response(routes), vocab_size=VOCAB, num_layers=LAYERS, topk=TOPK, num_experts=experts
    )
    assert sample.routed_experts.dtype == torch.int16
    assert sample.routed_experts.tolist() == routes


@pytest.mark.parametrize("encode", [lambda r: json.dumps(r).encode(), json.dumps], ids=["bytes", "str"])
def test_raw_json_parses_like_a_dict(encode):
    from_raw = parse_generate_response(PROMPT, encode(good_response()), **LAYOUT)
    from_dict = parse_generate_response(PROMPT, good_response(), **LAYOUT)
    assert torch.equal(from_raw.routed_experts, from_dict.routed_experts)
    assert torch.equal(from_raw.rollout_logprobs, from_dict.rollout_logprobs)


def test_tiny_positive_logprob_is_rounding_and_clamped_to_zero():
    response = good_response()
    response["meta_info"]["output_token_logprobs"][1][0] = 5e-7
    sample = parse_generate_response(PROMPT, response, **LAYOUT)
    assert sample.rollout_logprobs.tolist() == [-0.25, 0.0, -0.125]


def test_routed_experts_absent_when_not_asked():
    sample = parse_generate_response(PROMPT, good_response(routes=None), vocab_size=VOCAB)
    assert sample.routed_experts is None


def test_routed_experts_need_a_layout_to_decode():
    with pytest.raises(ValueError, match="num_layers, topk and num_experts") as info:
        parse_generate_response(PROMPT, good_response(), vocab_size=VOCAB)
    assert not isinstance(info.value, RolloutValidationError)  # a caller error, not a bad response


def test_errors_name_the_sample():
    response = good_response()
    response["meta_info"]["output_token_logprobs"][0][0] = float("nan")
    with pytest.raises(InvalidLogprobError, match="sample req-0: field"):
        parse_generate_response(PROMPT, response, **LAYOUT)


# ---- the corpus of bad responses ------------------------------------------------------------


def _set(path, value):
    def mutate(r):
        *head, last = path
        node = r
        for key in head:
            node = node[key]
        node[last] = value
        return r

    return mutate


def _delete(path):
    def mutate(r):
        *head, last = path
        node = r
        for key in head:
            node = node[key]
        del node[last]
        return r

    return mutate


def _both_token(i, token):
    """Change generated token i consistently in output_ids and output_token_logprobs."""

    def mutate(r):
        r["output_ids"][i] = token
        r["meta_info"]["output_token_logprobs"][i][1] = token
        return r

    return mutate


def _empty(r):
    r["output_ids"] = []
    r["meta_info"]["output_token_logprobs"] = []
    r["meta_info"]["completion_tokens"] = 0
    r["meta_info"]["output_token_logprobs_length"] = 0
    return r


def _routes(routes):
    return _set(["meta_info", "routed_experts"], encode_routes(routes))


_REPEATED = copy.deepcopy(ROUTES)
_REPEATED[2][1] = [5, 5]
_TOO_LARGE = copy.deepcopy(ROUTES)
_TOO_LARGE[0][0][1] = EXPERTS
_NEGATIVE = copy.deepcopy(ROUTES)
_NEGATIVE[4][1][0] = -1
_ONE_ROW_TOO_MANY = ROUTES + [ROUTES[0]]  # [T, L, k] instead of [T-1, L, k]
M = "meta_info"
LP = "meta_info.output_token_logprobs"
RE = "meta_info.routed_experts"
FR = "meta_info.finish_reason"

BAD = {
    "not_json": (lambda r: b"{not json", MalformedResponseError, "response"),
    "json_list": (lambda r: "[1, 2]", MalformedResponseError, "response"),
    "error_body": (lambda r: {"error": {"message": "boom"}}, MalformedResponseError, "error"),
    "meta_missing": (_delete([M]), MalformedResponseError, M),
    "meta_not_dict": (_set([M], [1, 2]), MalformedResponseError, M),
    "output_ids_missing": (_delete(["output_ids"]), MalformedResponseError, "output_ids"),
    "output_ids_string": (_set(["output_ids"], "9 4 2"), MalformedResponseError, "output_ids"),
    "output_id_float": (_set(["output_ids", 1], 4.0), MalformedResponseError, "output_ids[1]"),
    "output_id_bool": (_set(["output_ids", 0], True), MalformedResponseError, "output_ids[0]"),
    "logprobs_missing": (_delete([M, "output_token_logprobs"]), MalformedResponseError, LP),
    "logprobs_not_list": (_set([M, "output_token_logprobs"], {"a": 1}), MalformedResponseError, LP),
    "logprob_entry_short": (
        _set([M, "output_token_logprobs", 0], [-0.1, 9]),
        MalformedResponseError,
        f"{LP}[0]",
    ),
    "logprob_token_string": (
        _set([M, "output_token_logprobs", 0, 1], "9"),
        MalformedResponseError,
        f"{LP}[0][1]",
    ),
    "logprob_text_int": (_set([M, "output_token_logprobs", 0, 2], 7), MalformedResponseError, f"{LP}[0][2]"),
    "logprob_count": (lambda r: r[M]["output_token_logprobs"].pop() and r, LengthMismatchError, LP),
    "logprob_nan": (
        _set([M, "output_token_logprobs", 1, 0], float("nan")),
        InvalidLogprobError,
        f"{LP}[1][0]",
    ),
    "logprob_inf": (
        _set([M, "output_token_logprobs", 1, 0], float("inf")),
        InvalidLogprobError,
        f"{LP}[1][0]",
    ),
    "logprob_neg_inf": (
        _set([M, "output_token_logprobs", 2, 0], float("-inf")),
        InvalidLogprobError,
        f"{LP}[2][0]",
    ),
    "logprob_positive": (_set([M, "output_token_logprobs", 0, 0], 0.5), InvalidLogprobError, f"{LP}[0][0]"),
    "logprob_null": (_set([M, "output_token_logprobs", 0, 0], None), InvalidLogprobError, f"{LP}[0][0]"),
    "logprob_string": (_set([M, "output_token_logprobs", 0, 0], "-0.1"), InvalidLogprobError, f"{LP}[0][0]"),
    "logprobs_length_field": (
        _set([M, "output_token_logprobs_length"], 5),
        LengthMismatchError,
        f"{M}.output_token_logprobs_length",
    ),
    "token_out_of_vocab": (_both_token(2, VOCAB), TokenIdError, "output_ids[2]"),
    "token_negative": (_both_token(0, -3), TokenIdError, "output_ids[0]"),
    "tokens_disagree": (_set(["output_ids", 1], 5), TokenIdError, "output_ids[1]"),
    "empty": (_empty, EmptyResponseError, "output_ids"),
    "prompt_tokens_disagree": (_set([M, "prompt_tokens"], 4), LengthMismatchError, f"{M}.prompt_tokens"),
    "prompt_tokens_missing": (_delete([M, "prompt_tokens"]), MalformedResponseError, f"{M}.prompt_tokens"),
    "prompt_tokens_string": (_set([M, "prompt_tokens"], "3"), MalformedResponseError, f"{M}.prompt_tokens"),
    "completion_tokens_disagree": (
        _set([M, "completion_tokens"], 2),
        LengthMismatchError,
        f"{M}.completion_tokens",
    ),
    "finish_missing": (_delete([M, "finish_reason"]), FinishReasonError, FR),
    "finish_string": (_set([M, "finish_reason"], "length"), FinishReasonError, FR),
    "finish_unknown_type": (_set([M, "finish_reason", "type"], "done"), FinishReasonError, f"{FR}.type"),
    "finish_abort": (
        _set([M, "finish_reason"], {"type": "abort", "message": "paused"}),
        FinishReasonError,
        FR,
    ),
    "finish_length_negative": (_set([M, "finish_reason", "length"], -1), FinishReasonError, f"{FR}.length"),
    "finish_matched_dict": (
        _set([M, "finish_reason"], {"type": "stop", "matched": {}}),
        FinishReasonError,
        f"{FR}.matched",
    ),
    "weight_version_int": (_set([M, "weight_version"], 3), WeightVersionError, f"{M}.weight_version"),
    "weight_versions_mixed": (
        _set(
            [M, "weight_versions"],
            [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}],
        ),
        WeightVersionError,
        f"{M}.weight_versions",
    ),
    "rid_mismatch": (_set([M, "id"], "req-7"), MalformedResponseError, f"{M}.id"),
    "routes_not_base64": (_set([M, "routed_experts"], "@@not base64@@"), RoutedExpertsError, RE),
    "routes_not_string": (_set([M, "routed_experts"], ROUTES), RoutedExpertsError, RE),
    "routes_wrong_size": (_routes(_ONE_ROW_TOO_MANY), RoutedExpertsError, RE),
    "routes_truncated": (
        _set([M, "routed_experts"], base64.b64encode(b"\x01\x00\x00").decode()),
        RoutedExpertsError,
        RE,
    ),
    "routes_expert_too_large": (_routes(_TOO_LARGE), RoutedExpertsError, RE),
    "routes_expert_negative": (_routes(_NEGATIVE), RoutedExpertsError, RE),
    "routes_repeat_in_topk": (_routes(_REPEATED), RoutedExpertsError, RE),
    "routes_missing": (_delete([M, "routed_experts"]), RoutedExpertsError, RE),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_response_is_rejected_with_a_named_error(name):
    mutate, error, field = BAD[name]
    response = mutate(good_response())
    with pytest.raises(error) as info:
        parse_generate_response(PROMPT, response, expect_routed_experts=True, rid="req-0", **LAYOUT)
    err = info.value
    assert isinstance(err, RolloutValidationError) and isinstance(err, ValueError)
    assert err.field == field
    assert f"field `{field}`" in str(err)


def test_the_good_response_each_bad_case_breaks_is_accepted():
    parse_generate_response(PROMPT, good_response(), expect_routed_experts=True, rid="req-0", **LAYOUT)


@pytest.mark.parametrize(
    ("prompt", "error", "field"),
    [
        ([], EmptyResponseError, "input_ids"),
        ([1, VOCAB], TokenIdError, "input_ids[1]"),
        ([1, -2], TokenIdError, "input_ids[1]"),
    ],
)
def test_bad_prompt_is_named(prompt, error, field):
    with pytest.raises(error) as info:
        parse_generate_response(prompt, good_response(routes=None), vocab_size=VOCAB)
    assert info.value.field == field


def test_routed_expert_messages_say_what_is_wrong():
    with pytest.raises(RoutedExpertsError, match=r"expected 80 = \(prompt\+completion-1=5\)"):
        parse_generate_response(PROMPT, BAD["routes_wrong_size"][0](good_response()), **LAYOUT)
    with pytest.raises(RoutedExpertsError, match=r"expert id 8 outside \[0, 8\)"):
        parse_generate_response(PROMPT, BAD["routes_expert_too_large"][0](good_response()), **LAYOUT)
    with pytest.raises(RoutedExpertsError, match="position 2, layer 1"):
        parse_generate_response(PROMPT, BAD["routes_repeat_in_topk"][0](good_response()), **LAYOUT)


def test_numpy_and_tensor_prompts_are_accepted():
    for prompt in (np.array(PROMPT), torch.tensor(PROMPT)):
        sample = parse_generate_response(prompt, good_response(), **LAYOUT)
        assert sample.prompt_ids.tolist() == PROMPT


def test_whole_array_checks_agree_with_the_entry_walk():
    """The fast path returns what the per-entry walk returns, and declines every entry it cannot vouch for."""
    import random

    from megatron_gspo.rollout import validation

    rng = random.Random(0)
    entries = [[-rng.random() * 5, rng.randrange(100), None if i % 3 else "x"] for i in range(500)]
    entries += [[0, 7, None], [1e-7, 8, "y"]]  # an int log-prob; a tiny positive one within tolerance
    fast = validation._logprob_entries_fast(entries, 1e-6)
    assert fast is not None
    assert fast[0] == [min(float(e[0]), 0.0) for e in entries] and fast[1] == [e[1] for e in entries]
    for bad in ([True, 1, None], [float("nan"), 1, None], [0.5, 1, None], [-1.0, 1.0, None], [-1.0, 1, 3],
                [-1.0, 1], (-1.0, 1, None, 0), [10**400, 1, None]):  # fmt: skip
        assert validation._logprob_entries_fast([*entries, list(bad)], 1e-6) is None, bad
