"""The embedded server's /pause_generation modes with a weight update landing mid-generation.

SGLang 0.5.x's modes (`PauseGenerationReqInput`): `abort` returns the running requests at once
(finish reason abort, the tokens generated so far); `in_place` halts them and goes on after
/continue_generation on the KV cache the old weights computed; `retract` halts them and
recomputes the cache with the weights served at /continue_generation. Each is checked against
teacher-forced passes of the two checkpoints: the tokens before the pause carry the old
weights' log-probs, those after it the new weights' (retract) or neither (in_place's old cache).

A pause or abort lands once the server reports TOKENS_IN output tokens of the generation decoded
(/get_server_info's num_generated_tokens), not after a sleep: the tokens before it are at least
that many, and LONG leaves the generation far from its end.
"""

import threading

import httpx
import pytest
import replayed_reference
import torch
from replayed_reference import teacher_forced

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

pytestmark = pytest.mark.slow  # an embedded server and 480-token generations: ~45 s

TOKENIZER = build_char_tokenizer()
CFG = tiny(vocab_size=len(TOKENIZER), init_std=0.2)
PROMPT = TOKENIZER.encode("12+34=")
LONG = 480  # tokens (the context is 512): the pause lands well inside the generation, fast box or slow
# fp32 decoding token by token (KV cache) vs one teacher-forced forward over up to ~490 positions:
# float noise up to ~1.2e-5 was seen; the other version's weights differ by > 1e-3.
DECODE_TOL = 5e-5
TOKENS_IN = 16  # output tokens decoded before the test pauses or aborts the generation


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return make_tiny_hf_checkpoint(root / "a", CFG, seed=0), make_tiny_hf_checkpoint(root / "b", CFG, seed=1)


@pytest.fixture(scope="module")
def server(checkpoints):
    with launch_embedded_server(
        checkpoints[0],
        extra_args=["--check-responses", "--weight-version", "0"],
        env={"SGLANG_HEALTH_CHECK_TIMEOUT": "1"},  # SGLang's 20 s wait before a paused /health's 503
    ) as srv:
        yield srv


def teacher_forced_logprobs(path, output_ids, routes=None):
    """log_softmax(logits) of each output token under the checkpoint at `path`, one full forward
    (routed as `routes` [positions, L, k] say, when given: see `replayed_reference`)."""
    logprobs, _ = teacher_forced(path, PROMPT + output_ids, routes=routes)
    return logprobs[len(PROMPT) - 1 :].gather(1, torch.tensor(output_ids)[:, None])[:, 0]


def routes_of(response):
    return replayed_reference.routes_of(response, CFG.num_layers, CFG.moe_topk)


def start_generation(server, rid, **extra):
    """A long seeded generation in a thread, TOKENS_IN tokens in; returns (thread, holder of its response)."""
    url = server.url
    holder = {}
    body = {
        **extra,
        "input_ids": PROMPT,
        "rid": rid,
        "sampling_params": {
            "max_new_tokens": LONG,
            "temperature": 1.0,
            "sampling_seed": 11,
            "ignore_eos": True,
        },
        "return_logprob": True,
    }

    def post():
        try:
            holder["r"] = httpx.post(f"{url}/generate", json=body, timeout=300).json()
        except httpx.HTTPError as err:  # the server went away under it
            holder["error"] = err

    thread = threading.Thread(target=post)
    before = server.generated_tokens()  # the server is idle: what follows is this generation's
    thread.start()
    server.wait_for_tokens(before + TOKENS_IN)
    return thread, holder


def logprobs_of(response):
    return torch.tensor([lp for lp, _, _ in response["meta_info"]["output_token_logprobs"]])


def first_mismatch(got, ref, tol=DECODE_TOL):
    bad = ((got - ref).abs() > tol).nonzero()
    return int(bad[0]) if len(bad) else len(got)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_weight_update_while_paused_mid_generation(server, checkpoints, mode):
    a, b = checkpoints
    url = server.url
    httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(a), "weight_version": "0"})
    thread, holder = start_generation(server, f"held-{mode}", return_routed_experts=True)
    assert httpx.post(f"{url}/flush_cache").status_code == 400  # SGLang flushes only when idle
    answer = httpx.post(f"{url}/pause_generation", json={"mode": mode}, timeout=60).json()
    assert answer["status"] == "ok"
    # in_place holds the request in the running batch; retract moves it to the waiting queue,
    # which a paused SGLang (`Scheduler.flush_cache`: is_fully_idle(ignore_waiting=True)) ignores.
    flush = httpx.post(f"{url}/flush_cache")
    assert (flush.status_code, flush.text) == (
        (400, "Flush cache failed.\n") if mode == "in_place" else (200, "Cache flushed.\n")
    )
    assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 503  # paused: no token came
    assert httpx.get(f"{url}/ready", timeout=30).status_code == 503  # SGLang's flag check, at once
    update = httpx.post(
        f"{url}/update_weights_from_disk", json={"model_path": str(b), "weight_version": "1"}, timeout=60
    )
    assert update.json()["success"] is True  # ran while the request was held mid-generation
    assert thread.is_alive()
    httpx.post(f"{url}/continue_generation", json={})
    assert httpx.get(f"{url}/ready", timeout=30).status_code == 200
    thread.join(300)
    assert httpx.post(f"{url}/flush_cache").status_code == 200  # idle again
    response = holder["r"]
    ids = response["output_ids"]
    assert len(ids) == LONG and response["meta_info"]["finish_reason"]["type"] == "length"
    assert response["meta_info"]["weight_version"] == "1"
    got = logprobs_of(response)
    ref_a = teacher_forced_logprobs(a, ids)  # a deterministic prefix: the seeded tokens before the pause
    # retract recomputed every position with b: its routes are all b's, and b's pass replays them
    ref_b = teacher_forced_logprobs(b, ids, routes_of(response) if mode == "retract" else None)
    n = first_mismatch(got, ref_a)
    assert TOKENS_IN <= n < LONG  # the update landed mid-generation, after the tokens seen
    # SGLang 0.5.23's spans (srt/utils/weight_versions.py): the tokens each version generated.
    assert response["meta_info"]["weight_versions"] == [
        {"version": "0", "start": 0, "end": n},
        {"version": "1", "start": n, "end": LONG},
    ]
    assert (got[:n] - ref_a[:n]).abs().max() < DECODE_TOL  # before the pause: the old weights
    after = (got[n:] - ref_b[n:]).abs().max()
    if mode == "retract":  # cache recomputed with b: exactly b's teacher-forced log-probs
        assert after < DECODE_TOL
    else:  # in_place: b's weights over a's cached keys/values, which a fresh b forward does not give
        assert after > 1e-3


def test_abort_mode_returns_the_tokens_so_far_and_holds_new_requests(server, checkpoints):
    a, _ = checkpoints
    url = server.url
    httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(a), "weight_version": "0"})
    thread, holder = start_generation(server, "aborted-by-pause", return_routed_experts=True)
    httpx.post(f"{url}/pause_generation", json={"mode": "abort"}, timeout=60)
    thread.join(60)
    response = holder["r"]
    ids = response["output_ids"]
    assert response["meta_info"]["finish_reason"]["type"] == "abort"
    assert TOKENS_IN <= len(ids) < LONG and response["meta_info"]["weight_version"] == "0"
    # Aborted while running, it finishes through SGLang's output stream: routes of every position.
    routes = routes_of(response)
    assert routes.shape[0] == len(PROMPT) + len(ids) - 1
    assert (logprobs_of(response) - teacher_forced_logprobs(a, ids, routes)).abs().max() < DECODE_TOL
    later, held = start_generation_while_paused(url)
    later.join(0.5)
    assert later.is_alive()  # held until /continue_generation
    httpx.post(f"{url}/continue_generation", json={})
    later.join(60)
    assert held["r"]["meta_info"]["finish_reason"]["type"] == "length"


def test_a_retracted_request_aborted_is_answered_from_the_waiting_queue_without_routes(server, checkpoints):
    """SGLang 0.5.23: a retracted request waits in the scheduler's queue; aborted there
    (`Scheduler.abort_request` -> `TokenizerManager._handle_abort_req`) it returns only the tokens
    already streamed to the tokenizer manager (a multiple of SGLANG_FORCE_STREAM_INTERVAL, 50
    for a non-streamed request), their log-probs, and no routed experts nor prompt/cached counts."""
    a, _ = checkpoints
    url = server.url
    httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(a), "weight_version": "0"})
    thread, holder = start_generation(server, "retracted-then-aborted", return_routed_experts=True)
    httpx.post(f"{url}/pause_generation", json={"mode": "retract"}, timeout=60)
    httpx.post(f"{url}/pause_generation", json={"mode": "abort"}, timeout=60)
    thread.join(60)
    httpx.post(f"{url}/continue_generation", json={})
    response = holder["r"]
    meta, ids = response["meta_info"], response["output_ids"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert "routed_experts" not in meta and "prompt_tokens" not in meta and "cached_tokens" not in meta
    assert len(ids) % 50 == 0 and len(ids) < LONG and meta["completion_tokens"] == len(ids)
    assert len(meta["output_token_logprobs"]) == len(ids) == meta["output_token_logprobs_length"]
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": len(ids)}]


def start_generation_while_paused(url):
    holder = {}
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    thread = threading.Thread(
        target=lambda: holder.setdefault("r", httpx.post(f"{url}/generate", json=body, timeout=120).json())
    )
    thread.start()
    return thread, holder


def test_abort_request_by_rid_ends_a_running_generation_only(server, checkpoints):
    a, _ = checkpoints
    url = server.url
    httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(a), "weight_version": "0"})
    thread, holder = start_generation(server, "to-abort", return_routed_experts=True)
    assert httpx.post(f"{url}/abort_request", json={"rid": "someone-else"}).status_code == 200
    assert httpx.post(f"{url}/abort_request", json={"rid": "to-abort"}).status_code == 200
    thread.join(60)
    response = holder["r"]
    assert response["meta_info"]["finish_reason"]["type"] == "abort"
    assert TOKENS_IN <= len(response["output_ids"]) < LONG
    got, ids = logprobs_of(response), response["output_ids"]
    assert (got - teacher_forced_logprobs(a, ids, routes_of(response))).abs().max() < DECODE_TOL


def test_sigterm_with_a_request_held_mid_generation_exits_within_the_grace(checkpoints):
    """In-flight requests get SHUTDOWN_GRACE_S, not aiohttp's 60 s: the server exits and the client hears."""
    with launch_embedded_server(checkpoints[0]) as srv:
        thread, holder = start_generation(srv, "held-at-exit")
        httpx.post(f"{srv.url}/pause_generation", json={"mode": "in_place"}, timeout=60)
        srv.process.terminate()
        # Before the fix it hung > 60 s (aiohttp's own shutdown wait, then the held batch's join).
        assert srv.process.wait(60) == 0, srv.output
    thread.join(60)
    assert not thread.is_alive() and "error" in holder  # the held request's client heard, not hung
