"""How `PartialRollouts` stitches a request's tries into one response (SGLang-shaped answers)."""

import base64

import numpy as np

from megatron_gspo.rollout import parse_generate_response
from megatron_gspo.rollout.partial import _Row, segments_of

L, K, E = 2, 2, 8
PROMPT = [1, 2, 3]


def answer(input_len, ids, version, start, finish, rid):
    """What SGLang answers: tokens, log-probs, routes for positions [start, input_len + len(ids) - 1)."""
    rows = np.arange(max(input_len + len(ids) - 1 - start, 0) * L * K, dtype="<i4") % E
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "id": rid,
            "prompt_tokens": input_len,
            "completion_tokens": len(ids),
            "finish_reason": finish,
            "weight_version": version,
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
            "routed_experts": base64.b64encode(rows.tobytes()).decode("ascii"),
        },
    }


def test_a_tokenless_abort_then_two_segments_merge_into_one_valid_response():
    body = {"input_ids": PROMPT, "rid": "r", "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 5, "sampling_seed": 9}}  # fmt: skip
    row = _Row(body)
    abort = {"type": "abort", "message": "paused"}
    # Aborted during its prefill: no token, yet routes for the prompt's positions.
    row.add(answer(3, [], "0", 0, abort, "r"))
    assert row.aborted and row.request() == body  # retried as it was
    row.add(answer(3, [10, 11], "0", 0, abort, "r"))
    again = row.request()
    assert again["input_ids"] == PROMPT + [10, 11] and again["sampling_params"]["max_new_tokens"] == 3
    assert again["routed_experts_start_len"] == 4 and again["rid"] == "r-seg1"
    assert again["sampling_params"]["sampling_seed"] != 9
    row.add(answer(5, [12, 13, 14], "1", 4, {"type": "length", "length": 3}, "r-seg1"))
    merged = row.merged()
    assert [(s.start, s.length, s.weight_version) for s in segments_of(merged)] == [(0, 2, "0"), (2, 3, "1")]
    sample = parse_generate_response(
        PROMPT, merged, rid="r", num_layers=L, topk=K, num_experts=E, expect_routed_experts=True
    )
    assert sample.response_ids.tolist() == [10, 11, 12, 13, 14] and sample.finish_reason == "length"
    assert sample.routed_experts.shape == (3 + 5 - 1, L, K)
