"""SGLangClient against small local HTTP servers that speak SGLang's /generate and control format.

The servers stand in for SGLang at the network boundary: they gate every /generate body
through SGLang's own request contract (a 400 with the contract's message, as the real server),
answer in SGLang's response format (checked against its response contract), and can be told to
fail N times with 503, drop connections, stay down, or be slow (to count requests in flight).
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_gspo.rollout import contract
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.errors import (
    MalformedResponseError,
    RolloutBatchTimeoutError,
    RolloutRequestError,
    RolloutServerError,
    WeightUpdateError,
)
from megatron_gspo.rollout.requests import build_generate_request
from megatron_gspo.rollout.types import RolloutBatch
from megatron_gspo.rollout.validation import parse_generate_response

VOCAB, LAYERS, TOPK, EXPERTS = 32, 2, 2, 8
API = contract.require()


def expected_output(input_ids, n):
    """The fake model: deterministic tokens and log-probs, so tests know the exact answer."""
    ids = [(sum(input_ids) + 3 * i) % VOCAB for i in range(n)]
    return ids, [-(i + 1) / 8 for i in range(n)]


def expected_routes(num_tokens):
    return [
        [[(t + la) % EXPERTS, (t + la + 1) % EXPERTS] for la in range(LAYERS)] for t in range(num_tokens - 1)
    ]


class FakeSGLang:
    """A threaded HTTP server speaking SGLang's protocol, with scripted failures and counters."""

    def __init__(
        self,
        *,
        fail_first=0,
        failure="503",
        delay_s=0.0,
        unhealthy_first=0,
        reject_rid=None,
        update_fails=False,
        hold=None,
        init_refusal=None,
        init_hold=None,
    ):
        self.fail_first = fail_first  # first N /generate attempts fail
        self.failure = failure  # "503" or "drop"
        self.delay_s = delay_s
        self.unhealthy_first = unhealthy_first
        self.reject_rid = reject_rid  # /generate with this rid gets a 400
        self.update_fails = update_fails
        self.hold = hold  # a threading.Event: accepted /generate requests wait for it (at most 60 s)
        self.init_refusal = init_refusal  # /init_weights_update_group answers 400 with this message
        self.init_hold = init_hold  # an Event: /init_weights_update_group waits for it (at most 10 s),
        # as a server waits in the group's rendezvous for ranks that may never come
        self.weight_version = "0"
        self.lock = threading.Lock()
        self.generate_attempts = 0
        self.served = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.health_calls = 0
        self.posts: list[tuple[str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/health":
                    with fake.lock:
                        fake.health_calls += 1
                        healthy = fake.health_calls > fake.unhealthy_first
                    self._send(200 if healthy else 503, b"")
                else:
                    self._send(404, b"")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                with fake.lock:
                    fake.posts.append((self.path, body))
                if self.path == "/generate":
                    return self._generate(body)
                if self.path == "/flush_cache":
                    return self._send(200, b"Cache flushed.\n")
                if self.path == "/update_weights_from_disk":
                    if fake.update_fails:
                        return self._json(400, {"success": False, "message": "file not found: /nope"})
                    fake.weight_version = body.get("weight_version", fake.weight_version)
                    return self._json(200, {"success": True, "message": "ok", "num_paused_requests": 0})
                if self.path == "/init_weights_update_group" and fake.init_refusal is not None:
                    return self._json(400, {"success": False, "message": fake.init_refusal})
                if self.path == "/init_weights_update_group" and fake.init_hold is not None:
                    fake.init_hold.wait(10)
                if self.path in ("/pause_generation", "/continue_generation"):
                    return self._json(200, {"message": "done", "status": "ok"})
                return self._json(200, {"success": True, "message": "ok"})

            def _generate(self, body):
                with fake.lock:
                    fake.generate_attempts += 1
                    failing = fake.generate_attempts <= fake.fail_first
                if failing and fake.failure == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if failing:
                    return self._json(503, {"error": {"message": "server overloaded"}})
                try:
                    request = API.GenerateRequest.from_json_value(body)
                except API.JsonContractError as err:  # SGLang's 400: the contract's own message
                    return self._json(400, {"error": {"message": str(err)}})
                if request.rid is not None and request.rid == fake.reject_rid:
                    return self._json(400, {"error": {"message": f"bad request {request.rid}"}})
                with fake.lock:
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    time.sleep(fake.delay_s)
                    if fake.hold is not None:
                        fake.hold.wait(60)
                    response = fake.respond(request, body)
                finally:
                    with fake.lock:
                        fake.in_flight -= 1
                        fake.served += 1
                self._json(200, response)

            def _json(self, code, obj):
                self._send(code, json.dumps(obj).encode(), "application/json")

            def _send(self, code, data, content_type="text/plain"):
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # dropped connections are intended

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True).start()

    def respond(self, request, body):
        if body.get("input_ids") and isinstance(body["input_ids"][0], list):  # a batch: one answer per row
            rows = [
                {**body, "input_ids": ids, "sampling_params": sp, "rid": rid}
                for ids, sp, rid in zip(
                    body["input_ids"], body["sampling_params"], body.get("rid") or [None] * 10**6
                )
            ]
            return [self.respond(API.GenerateRequest.from_json_value(row), row) for row in rows]
        ids = list(request.input_ids)
        n = request.sampling_params.max_new_tokens
        out, lps = expected_output(ids, n)
        meta = {
            "id": request.rid or "x",
            "prompt_tokens": len(ids),
            "completion_tokens": n,
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": n},
            "weight_version": self.weight_version,
        }
        if request.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out)]
            meta["output_token_logprobs_length"] = n
        if body.get("return_routed_experts"):
            routes = expected_routes(len(ids) + n)[request.routed_experts_start_len :]
            flat = [e for row in routes for layer in row for e in layer]
            meta["routed_experts"] = base64.b64encode(struct.pack(f"<{len(flat)}i", *flat)).decode()
        response = {"text": "", "output_ids": out, "meta_info": meta}
        API.GenerateResponse.from_json_value(response)  # self-check: SGLang's response contract
        return response

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    started = []

    def start(**kwargs):
        server = FakeSGLang(**kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.fixture
def dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there any more


def client_for(*urls, **kwargs):
    options = dict(max_concurrency=4, timeout_s=5.0, connect_timeout_s=1.0, max_retries=3, backoff_s=0.01)
    options.update(kwargs)
    return SGLangClient(list(urls), **options)


def requests_for(n, *, max_new_tokens=3, routed=False):
    return [
        build_generate_request(
            [1 + i, 2, 3],
            {"max_new_tokens": max_new_tokens, "temperature": 1.0},
            return_routed_experts=routed,
            rid=f"r{i}",
        )
        for i in range(n)
    ]


# ---- request building -----------------------------------------------------------------------


def test_build_generate_request_passes_sglang_contract():
    body = build_generate_request(
        [5, 6], {"max_new_tokens": 4, "top_p": 0.9}, return_routed_experts=True, rid="a"
    )
    request = API.GenerateRequest.from_json_value(body)
    assert list(request.input_ids) == [5, 6] and request.rid == "a" and request.return_logprob is True
    assert request.sampling_params.max_new_tokens == 4 and request.routed_experts_start_len == 0
    assert body["return_routed_experts"] is True and body["stream"] is False
    plain = build_generate_request([5], {})
    assert "return_routed_experts" not in plain and "rid" not in plain


def test_build_generate_request_rejects_bad_input_with_reasons():
    with pytest.raises(ValueError, match="unknown field `temprature`"):
        build_generate_request([1], {"temprature": 0.5})
    with pytest.raises(ValueError, match="empty"):
        build_generate_request([], {})
    with pytest.raises(ValueError, match="non-negative integers, found -1"):
        build_generate_request([1, -1], {})
    # A caller that checked the batch's first row's params skips the rest; prompts are always checked.
    assert build_generate_request([1], {"temprature": 0.5}, check_sampling_params=False)["input_ids"] == [1]
    with pytest.raises(ValueError, match="non-negative integers, found -1"):
        build_generate_request([1, -1], {}, check_sampling_params=False)
    # A prompt id outside the model's vocabulary kills SGLang's scheduler (tests/rollout/
    # test_real_sglang.py): refused before it is sent.
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 80\): \[80, 500\]"):
        build_generate_request([1, 500, 80, 79], {}, vocab_size=80)
    assert build_generate_request([1, 79], {}, vocab_size=80)["input_ids"] == [1, 79]


# ---- generation -----------------------------------------------------------------------------


def test_generate_returns_every_response_in_order_and_they_validate(servers):
    server = servers()
    prompts = [[1 + g, 2, 3] for g in range(3)]
    group_size = 2
    requests = [
        build_generate_request(p, {"max_new_tokens": 3}, return_routed_experts=True, rid=f"g{g}-{j}")
        for g, p in enumerate(prompts)
        for j in range(group_size)
    ]
    with client_for(server.url) as client:
        responses = client.generate(requests)
    samples = []
    for i, response in enumerate(responses):
        g = i // group_size
        sample = parse_generate_response(
            prompts[g],
            response,
            vocab_size=VOCAB,
            num_layers=LAYERS,
            topk=TOPK,
            num_experts=EXPERTS,
            expect_routed_experts=True,
            rid=f"g{g}-{i % group_size}",  # also checks the order: meta_info.id must match
        )
        out, lps = expected_output(prompts[g], 3)
        assert sample.response_ids.tolist() == out and sample.rollout_logprobs.tolist() == lps
        assert sample.routed_experts.tolist() == expected_routes(6)
        sample.group_index = g
        samples.append(sample)
    batch = RolloutBatch.from_samples(samples, group_size=group_size, expected_weight_version="0")
    assert batch.tokens.shape == (6, 6) and batch.num_groups == 3
    assert batch.tokens[:, 0].tolist() == [1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("failure", ["503", "drop"])
def test_transient_failures_are_retried_then_succeed(servers, failure):
    server = servers(fail_first=2, failure=failure)
    with client_for(server.url, max_retries=3, backoff_s=0.02) as client:
        start = time.monotonic()
        [response] = client.generate(requests_for(1))
        elapsed = time.monotonic() - start
    assert server.generate_attempts == 3 and server.served == 1
    assert response["output_ids"] == expected_output([1, 2, 3], 3)[0]
    assert elapsed >= 0.02 + 0.04  # exponential backoff: 0.02 s, then 0.04 s


def test_server_that_stays_down_fails_after_exactly_max_retries_plus_one(servers):
    server = servers(fail_first=10**6)
    with client_for(server.url, max_retries=2) as client, pytest.raises(RolloutServerError) as info:
        client.generate(requests_for(1))
    err = info.value
    assert server.generate_attempts == 3 and err.attempts == 3
    assert err.url == server.url and err.path == "/generate"
    assert "HTTP 503" in err.last_error and "server overloaded" in err.last_error
    assert server.url in str(err) and "3 attempt(s)" in str(err)


def test_unreachable_server_names_url_and_attempts(dead_url):
    with client_for(dead_url, max_retries=1) as client, pytest.raises(RolloutServerError) as info:
        client.generate(requests_for(1))
    assert info.value.attempts == 2 and info.value.url == dead_url
    assert "ConnectError" in info.value.last_error


def test_400_is_not_retried_and_surfaces_the_server_message(servers):
    server = servers()
    body = {"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}, "return_logprob": True}
    with client_for(server.url) as client, pytest.raises(RolloutRequestError) as info:
        client.generate([body])
    assert server.generate_attempts == 1
    assert info.value.status_code == 400 and info.value.url == server.url
    assert "unknown field `temprature`" in info.value.server_message
    assert "unknown field `temprature`" in str(info.value)


def test_concurrency_bound_is_respected(servers):
    server = servers(delay_s=0.05)
    with client_for(server.url, max_concurrency=3) as client:
        responses = client.generate(requests_for(12))
    assert len(responses) == 12 and server.served == 12
    assert server.max_in_flight == 3  # reached, never exceeded


def test_failed_batch_raises_and_leaves_nothing_running(servers):
    """r0 is held on the server until the client reports the batch failed (r1's 400): by then the
    eight queued requests must be dropped, whichever thread runs first."""
    failed = threading.Event()
    server = servers(reject_rid="r1", hold=failed)
    with client_for(server.url, max_concurrency=2) as client:
        client.on_batch_failed = failed.set
        with pytest.raises(RolloutRequestError, match="bad request r1"):
            client.generate(requests_for(10))
        assert server.in_flight == 0  # everything of the failed batch finished before the raise
        assert server.generate_attempts == 2 and server.served == 1  # r0, r1; the queued ones not sent
        client.on_batch_failed = None
        # The client is still usable afterwards.
        server.reject_rid = None
        assert len(client.generate(requests_for(2))) == 2


def test_dead_server_fails_over_to_a_live_one(servers, dead_url):
    live = servers()
    with client_for(dead_url, live.url, max_retries=1) as client:
        responses = client.generate(requests_for(6))
    assert len(responses) == 6 and live.served == 6


def test_requests_spread_over_servers(servers):
    a, b = servers(delay_s=0.03), servers(delay_s=0.03)
    with client_for(a.url, b.url, max_concurrency=4) as client:
        client.generate(requests_for(12))
    assert a.served + b.served == 12 and a.served >= 1 and b.served >= 1
    # Least-loaded routing: with 4 requests in flight neither server ever holds a third while the
    # other is not busier (an order of events, whatever the box's speed).
    assert a.max_in_flight <= 2 and b.max_in_flight <= 2, (a.max_in_flight, b.max_in_flight)


# ---- health ---------------------------------------------------------------------------------


def test_wait_until_healthy_polls_until_200(servers):
    server = servers(unhealthy_first=3)
    with client_for(server.url) as client:
        client.wait_until_healthy(timeout_s=5.0, poll_s=0.01)
        assert client.health() == {server.url: True}
    assert server.health_calls == 5  # 3 unhealthy polls, the 4th succeeds, then health()


def test_wait_until_healthy_times_out_naming_the_server(servers, dead_url):
    live = servers()
    with client_for(live.url, dead_url) as client:
        assert client.health() == {live.url: True, dead_url: False}
        with pytest.raises(RolloutServerError) as info:
            client.wait_until_healthy(timeout_s=0.2, poll_s=0.05)
    assert info.value.url == dead_url and info.value.urls == [dead_url] and info.value.path == "/health"


# ---- weight sync and control ----------------------------------------------------------------


def test_update_weights_from_disk_reaches_every_server_and_versions_follow(servers):
    a, b = servers(), servers()
    with client_for(a.url, b.url) as client:
        answers = client.update_weights_from_disk("/ckpt/step5", weight_version=5)
        responses = client.generate(requests_for(4))
    assert [x["success"] for x in answers] == [True, True]
    for server in (a, b):
        [(path, body)] = [p for p in server.posts if p[0] == "/update_weights_from_disk"]
        assert body == {
            "model_path": "/ckpt/step5",
            "weight_version": "5",
            "flush_cache": True,
            "abort_all_requests": False,
        }
    assert {r["meta_info"]["weight_version"] for r in responses} == {"5"}


def test_failed_weight_update_raises_with_the_server_message_without_retry(servers):
    good, bad = servers(), servers(update_fails=True)
    with client_for(good.url, bad.url) as client, pytest.raises(WeightUpdateError) as info:
        client.update_weights_from_disk("/nope", weight_version=1)
    assert info.value.url == bad.url and "file not found: /nope" in info.value.server_message
    assert "1 of 2 failed" in str(info.value)
    assert len([p for p in bad.posts if p[0] == "/update_weights_from_disk"]) == 1


def test_distributed_update_calls_send_the_right_fields(servers):
    a, b = servers(), servers()
    with client_for(a.url, b.url) as client:
        future = client.init_weights_update_group(
            master_address="10.0.0.1", master_port=29600, world_size=5, rank_offsets=[1, 3], blocking=False
        )
        assert [x["success"] for x in future.result(timeout=5)] == [True, True]
        client.update_weights_from_distributed(
            ["w.a", "w.b"], ["bfloat16", "torch.float32"], [[2, 3], [4]], weight_version="7"
        )
        client.update_weights_from_tensor(["c2VyaWFsaXplZA=="], weight_version=7)
        tensor_posts = {id(s): len(s.posts) for s in (a, b)}
        client.update_weights_from_tensor([["YQ=="], ["Yg==", "Yw=="]], load_format="flattened_bucket")
        per_server = [s.posts[tensor_posts[id(s)]][1]["serialized_named_tensors"] for s in (a, b)]
        client.release_memory_occupation(["kv_cache"])
        client.resume_memory_occupation()
        client.destroy_weights_update_group()
        client.pause_generation(mode="retract")
        client.flush_cache()
        client.continue_generation()
    posts = dict(b.posts)
    assert posts["/init_weights_update_group"] == {
        "master_address": "10.0.0.1",
        "master_port": 29600,
        "rank_offset": 3,
        "world_size": 5,
        "group_name": "weight_update_group",
        "backend": "nccl",
    }
    assert dict(a.posts)["/init_weights_update_group"]["rank_offset"] == 1
    assert posts["/update_weights_from_distributed"] == {
        "names": ["w.a", "w.b"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[2, 3], [4]],
        "group_name": "weight_update_group",
        "flush_cache": True,
        "weight_version": "7",
    }
    assert next(body for path, body in b.posts if path == "/update_weights_from_tensor") == {
        "serialized_named_tensors": ["c2VyaWFsaXplZA=="],
        "flush_cache": True,
        "weight_version": "7",
    }
    assert per_server == [["YQ=="], ["Yg==", "Yw=="]]  # one list per server: its TP ranks' entries
    for server in (a, b):  # memory calls reach every server
        memory = dict(server.posts)
        assert memory["/release_memory_occupation"] == {"tags": ["kv_cache"]}
        assert memory["/resume_memory_occupation"] == {}
    assert posts["/destroy_weights_update_group"] == {"group_name": "weight_update_group"}
    assert posts["/pause_generation"] == {"mode": "retract"}
    assert [p for p, _ in b.posts][-3:] == ["/pause_generation", "/flush_cache", "/continue_generation"]


def test_a_refused_group_join_is_raised_without_waiting_for_servers_held_in_it(servers):
    # One server refuses the group, the other waits in its rendezvous for ranks that will not come
    # (until its own timeout): the refusal is the answer, at once.
    hold = threading.Event()
    held, refusing = servers(init_hold=hold), servers(init_refusal="backend='nccl' needs a CUDA device")
    start = time.monotonic()
    try:
        with (
            client_for(held.url, refusing.url, timeout_s=30.0) as client,
            pytest.raises(WeightUpdateError) as info,
        ):
            client.init_weights_update_group(
                master_address="x", master_port=1, world_size=3, rank_offsets=[1, 2]
            )
        assert time.monotonic() - start < 2.0 and not hold.is_set()
    finally:
        hold.set()
    assert info.value.url == refusing.url and "needs a CUDA device" in info.value.server_message
    assert "not awaited" in str(info.value)


def test_client_arguments_are_checked():
    with pytest.raises(ValueError, match="at least one"):
        SGLangClient([])
    with pytest.raises(ValueError, match="duplicate"):
        SGLangClient(["http://a:1", "http://a:1/"])
    with (
        pytest.raises(ValueError, match="rank_offsets"),
        SGLangClient(["http://a:1", "http://b:1"]) as client,
    ):
        client.init_weights_update_group(master_address="x", master_port=1, world_size=3)


def test_generate_batched_refuses_an_answer_that_is_not_one_object_per_row(servers, monkeypatch):
    server = servers()
    # A server that answers a batch body with a single object instead of one per row.
    monkeypatch.setattr(
        server, "respond", lambda request, body: {"text": "", "output_ids": [], "meta_info": {}}
    )
    with client_for(server.url) as client:
        with pytest.raises(MalformedResponseError, match="for a batch of 2 rows, expected a list of objects"):
            client.generate_batched(requests_for(2))


@pytest.mark.parametrize("batched", [False, True])
def test_batch_timeout_names_the_pending_server_cancels_and_aborts(servers, batched):
    answer = threading.Event()  # the slow server answers nothing until the test says so
    fast, slow = servers(), servers(hold=answer)
    # 2 s: time enough for the fast server's share on a busy box (pending < 6 below).
    with client_for(fast.url, slow.url, batch_timeout_s=2.0, timeout_s=70.0, max_concurrency=8) as client:
        start = time.monotonic()
        with pytest.raises(RolloutBatchTimeoutError) as info:
            (client.generate_batched if batched else client.generate)(requests_for(6))
        elapsed = time.monotonic() - start
        err = info.value
        assert elapsed >= 2.0 and slow.served == 0  # raised before the slow server answered any request
        assert err.pending_urls == [slow.url] and fast.url not in str(err) and slow.url in str(err)
        assert err.total == 6 and 1 <= err.pending < 6 and "rollout.batch_timeout_s" in str(err)
        # The in-flight requests are aborted by rid on the slow server only.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(p == "/abort_request" for p, _ in slow.posts):
            time.sleep(0.02)
        answer.set()  # the held requests end (the real server answers aborted ones at once)
        aborted = {b["rid"] for p, b in slow.posts if p == "/abort_request"}
        sent = {rid for p, b in slow.posts if p == "/generate" for rid in _rids(b.get("rid"))}
        assert aborted and aborted <= sent
        assert not any(p == "/abort_request" for p, _ in fast.posts)


def test_batch_timeout_not_hit_by_a_batch_that_finishes(servers):
    server = servers(delay_s=0.05)
    with client_for(server.url, batch_timeout_s=5.0) as client:
        assert len(client.generate(requests_for(8))) == 8
        assert len(client.generate_batched(requests_for(8))) == 8
    with pytest.raises(ValueError, match="batch_timeout_s"):
        SGLangClient(["http://a:1"], batch_timeout_s=0)


def _rids(rid):
    return rid if isinstance(rid, list) else [rid]  # a batch request carries one rid per row


def test_control_calls_to_a_fleet_emptied_by_removals_tell_no_one(dead_url):
    """`remove_unhealthy_workers` can leave no worker; the pause around that sync still ends with
    /continue_generation (to no one), so the FleetTooSmallError is what the run stops with."""
    with client_for(dead_url) as client:
        client.urls = []  # as the removals leave it
        assert client.continue_generation() == [] and client.pause_generation("abort") == []
