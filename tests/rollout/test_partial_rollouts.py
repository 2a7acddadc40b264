"""Partial rollouts: a weight sync lands mid-generation, responses come back as per-version segments.

Each segment's log-probs and routed experts are checked against a teacher-forced pass of
the weights that generated it (checkpoint a before the sync, b after), over the whole
merged sequence: a segment is the continuation of prompt + earlier tokens under its version.

The sync begins once the server reports TOKENS_IN output tokens of each row decoded
(/get_server_info's num_generated_tokens), not after a sleep: the first segments are at least
that long, and LONG leaves the generation far from its end.
"""

import threading

import numpy as np
import pytest
import torch
from replayed_reference import routes_of, teacher_forced

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.rollout import SGLangClient, build_generate_request, parse_generate_response
from megatron_gspo.rollout.partial import PartialRollouts, segments_of
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
CFG = tiny(vocab_size=len(TOKENIZER), init_std=0.2)
PROMPTS = [TOKENIZER.encode("12+34="), TOKENIZER.encode("7*8=")]
LONG = 480  # the context is 512: long enough that the sync lands mid-generation on a fast box too
TEMPERATURE = 0.8
# fp32 decoding token by token (KV cache) vs one teacher-forced forward over up to ~490 positions
# routed as the server routed (a near-tie flipped by float noise cost 4.3e-2 once in CI):
# float noise up to 1.2e-5 was seen (CI); the other version's weights differ by > 1e-2.
DECODE_TOL = 5e-5
TOKENS_IN = 16  # output tokens of each row decoded before the sync begins


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return make_tiny_hf_checkpoint(root / "a", CFG, seed=0), make_tiny_hf_checkpoint(root / "b", CFG, seed=1)


def routes_agree(routed, probs):
    """Routed expert sets equal the top-k of `probs` (near-ties, < 1e-5 apart, excused)."""
    k = CFG.moe_topk
    ref = probs.topk(k, dim=-1).indices.sort(-1).values.numpy()
    ordered = probs.sort(-1, descending=True).values
    tie = (ordered[..., k - 1] - ordered[..., k]).numpy() < 1e-5
    return bool(((np.sort(routed, -1) == ref).all(-1) | tie).all())


@pytest.mark.slow  # ~33 s on a loaded 2-core box: two 480-token generations, four teacher-forced passes
def test_sync_mid_generation_gives_segments_with_their_versions_logprobs_and_routes(checkpoints):
    a, b = checkpoints
    with (
        launch_embedded_server(a, extra_args=["--check-responses", "--weight-version", "0"]) as server,
        SGLangClient([server.url]) as client,
    ):
        partial = PartialRollouts(client)
        params = {"max_new_tokens": LONG, "temperature": TEMPERATURE, "ignore_eos": True}
        bodies = [
            build_generate_request(
                p, {**params, "sampling_seed": 7 + i}, rid=f"row{i}", return_routed_experts=True
            )
            for i, p in enumerate(PROMPTS)
        ]
        holder = {}
        thread = threading.Thread(target=lambda: holder.setdefault("r", partial.generate(bodies)))
        before = server.generated_tokens()
        thread.start()
        server.wait_for_tokens(before + TOKENS_IN * len(bodies))  # the rows decode in one batch
        with partial.sync():
            client.update_weights_from_disk(str(b), weight_version=1)
        thread.join(300)
        responses = holder["r"]

    for prompt, body, response in zip(PROMPTS, bodies, responses):
        segments = segments_of(response)
        assert [s.weight_version for s in segments] == ["0", "1"]
        assert segments[0].start == 0 and segments[1].start == segments[0].length >= TOKENS_IN
        assert sum(s.length for s in segments) == LONG
        sample = parse_generate_response(
            prompt, response, rid=body["rid"], expect_routed_experts=True, vocab_size=CFG.vocab_size,
            num_layers=CFG.num_layers, topk=CFG.moe_topk, num_experts=CFG.num_experts,
        )  # fmt: skip
        assert sample.response_length == LONG and sample.finish_reason == "length"
        seq = prompt + response["output_ids"]
        p, cut = len(prompt), segments[0].length
        got = sample.rollout_logprobs.double()
        routed = routes_of(response, CFG.num_layers, CFG.moe_topk)  # rows checked by parse_generate_response
        for path, seg in ((a, segments[0]), (b, segments[1])):
            # Routes: the rows whose token the segment predicted (positions p-1+start ...); the
            # reference replays them, and routes the earlier rows (another version's) itself.
            rows = slice(0 if seg.start == 0 else p - 1 + seg.start, p - 1 + seg.start + seg.length)
            replay = np.full_like(routed, -1)
            replay[rows] = routed[rows]
            logprobs, router = teacher_forced(path, seq, temperature=TEMPERATURE, routes=replay)
            positions = torch.arange(p - 1 + seg.start, p - 1 + seg.start + seg.length)
            ref = logprobs[positions].gather(1, torch.tensor(seq)[positions + 1, None])[:, 0].double()
            assert (got[seg.start : seg.start + seg.length] - ref).abs().max() < DECODE_TOL, path
            assert routes_agree(routed[rows], router[rows]), path
        # The other version's weights really differ on the second segment.
        logprobs_a, _ = teacher_forced(a, seq, temperature=TEMPERATURE)
        positions = torch.arange(p - 1 + cut, len(seq) - 1)
        ref_a = logprobs_a[positions].gather(1, torch.tensor(seq)[positions + 1, None])[:, 0].double()
        assert (got[cut:] - ref_a).abs().max() > 1e-2


@pytest.mark.slow  # ~15 s: one 480-token generation cut and regenerated, one teacher-forced pass
def test_a_retracted_then_aborted_segment_is_regenerated_never_merged_short_of_routes(
    checkpoints, monkeypatch
):
    """SGLang 0.5.23 answers a request aborted after a retract (pause mode retract here; memory
    pressure in production) from its waiting queue: tokens and log-probs, no routed experts
    (`TokenizerManager._handle_abort_req`). Such a segment must be dropped and its tokens
    generated again, never merged into a response whose routes come up short.

    Red before the fix: the route-less tokens were kept, the merged routes lacked their rows
    and `parse_generate_response` refused the response (RoutedExpertsError)."""
    a, b = checkpoints
    # Every token reaches SGLang's tokenizer manager at once (its default, 50, streams a
    # non-streamed request's tokens in fifties): the aborted request returns all its tokens.
    monkeypatch.setenv("SGLANG_FORCE_STREAM_INTERVAL", "1")
    with (
        launch_embedded_server(a, extra_args=["--check-responses", "--weight-version", "0"]) as server,
        SGLangClient([server.url]) as client,
    ):
        partial = PartialRollouts(client)
        params = {"max_new_tokens": LONG, "temperature": TEMPERATURE, "ignore_eos": True, "sampling_seed": 3}
        body = build_generate_request(PROMPTS[0], params, rid="row0", return_routed_experts=True)
        holder = {}
        thread = threading.Thread(target=lambda: holder.setdefault("r", partial.generate([body])))
        before = server.generated_tokens()
        thread.start()
        server.wait_for_tokens(before + TOKENS_IN)
        client.pause_generation("retract")  # the request goes back to the waiting queue
        with partial.sync():  # aborts it there: tokens without routes
            client.update_weights_from_disk(str(b), weight_version=1)
        thread.join(300)
        (response,) = holder["r"]

    segments = segments_of(response)
    assert [(s.start, s.length, s.weight_version) for s in segments] == [(0, LONG, "1")]  # all regenerated
    sample = parse_generate_response(
        PROMPTS[0], response, rid="row0", expect_routed_experts=True, vocab_size=CFG.vocab_size,
        num_layers=CFG.num_layers, topk=CFG.moe_topk, num_experts=CFG.num_experts,
    )  # fmt: skip
    assert sample.response_length == LONG and sample.routed_experts.shape[0] == len(PROMPTS[0]) + LONG - 1
    seq = PROMPTS[0] + response["output_ids"]
    routed = routes_of(response, CFG.num_layers, CFG.moe_topk)
    logprobs, router = teacher_forced(b, seq, temperature=TEMPERATURE, routes=routed)
    p = len(PROMPTS[0])
    positions = torch.arange(p - 1, len(seq) - 1)
    ref = logprobs[positions].gather(1, torch.tensor(seq)[positions + 1, None])[:, 0].double()
    assert (sample.rollout_logprobs.double() - ref).abs().max() < DECODE_TOL  # b's, every token
    assert routes_agree(routed, router[:-1])
