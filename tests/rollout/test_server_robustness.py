"""The embedded server answers every request: malformed bytes, bad fields, huge bodies, load.

Raw sockets where the framing itself is broken; the field sweeps take their field lists from
SGLang's own contract types (not from the server's tables), so a field the server forgets to
check fails here.
"""

import concurrent.futures as cf
import http.client
import json
import shutil
import socket
import subprocess
import time
import typing
from urllib.parse import urlsplit

import httpx
import pytest

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.rollout import contract
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
CFG = tiny(vocab_size=len(TOKENIZER))
PROMPT = TOKENIZER.encode("12+34=")
MAX_BODY_MB = 1
MAX_BATCH = 4  # the server's /generate thread pool then holds MAX_BATCH + 32 threads
HEALTH_WAIT_S = 3  # the server's SGLANG_HEALTH_CHECK_TIMEOUT (SGLang's default: 20 s)
POST_PATHS = (
    "/generate",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/flush_cache",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("robust") / "m", CFG, seed=0)
    with launch_embedded_server(
        ckpt,
        extra_args=["--max-body-mb", str(MAX_BODY_MB), "--max-batch-size", str(MAX_BATCH)],
        env={"SGLANG_HEALTH_CHECK_TIMEOUT": str(HEALTH_WAIT_S)},
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


def _address(server):
    parts = urlsplit(server.url)
    return parts.hostname, parts.port


def _read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP response from `sock`: status, headers (lower-case), body (Content-Length framed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed without a complete response: {data!r}"
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside the response body"
        rest += chunk
    return status, headers, rest[:length]


def _raw(server, request: bytes) -> tuple[int, dict, bytes, socket.socket]:
    sock = socket.create_connection(_address(server), timeout=30)
    sock.sendall(request)
    return (*_read_response(sock), sock)


def _post_bytes(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + extra
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def _message(response) -> str:
    return response.text if response.status_code != 400 else json.dumps(response.json())


@pytest.mark.parametrize(
    "value", [b"-5", b"abc", b"1e3", b"99999999999999999999999", b"", b"5, 6", b"+5", b"0x10", b"5 5"]
)
def test_bad_content_length_gets_400_naming_the_header(server, value):
    status, _, body, sock = _raw(
        server, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: " + value + b"\r\n\r\n{}"
    )
    sock.close()
    assert status == 400 and b"Content-Length" in body, body


# Bodies that are not UTF-8: a stray byte, a truncated sequence, an encoded surrogate, Latin-1.
NOT_UTF8 = [
    b"\xff",
    b'{"input_ids": [1], "x": "\xc3\x28"}',
    b'{"text": "\xed\xa0\x80"}',
    b'{"text": "caf\xe9"}',
]


@pytest.mark.parametrize("path", POST_PATHS)
def test_undecodable_bodies_get_400_and_the_connection_stays_usable(server, path):
    sock = socket.create_connection(_address(server), timeout=30)
    try:
        huge_int = b'{"input_ids": [' + b"9" * 5000 + b"]}"  # past Python's int-parsing digit limit
        for body in [
            *NOT_UTF8,
            b"{not json",
            b"[" * 100_000 + b"]" * 100_000,
            b'{"a":' * 50_000 + b"1",
            huge_int,
        ]:
            sock.sendall(_post_bytes(path, body))
            (
                status,
                _,
                answer,
            ) = _read_response(sock)
            assert status == 400, (path, body[:40], answer)
            text = json.loads(answer)["error"]["message"]
            assert any(word in text for word in ("UTF-8", "not JSON", "nested too deeply")), text
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # same connection: still served
        assert _read_response(sock)[0] == 200
    finally:
        sock.close()


@pytest.mark.parametrize(
    "template",
    [
        '{"input_ids": [1, 2], "sampling_params": {"custom_params": %s}}',
        '{"input_ids": [1, 2], "sampling_params": {"logit_bias": {"1": %s}}}',
        '{"input_ids": [1, 2], "rid": %s}',
        '{"input_ids": [1, 2], "sampling_params": %s}',
        '{"input_ids": %s}',
        '{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, "unknown": %s}',
    ],
)
def test_deep_json_inside_a_field_gets_400(server, client, template):
    """Nesting the parser just accepts (depths up to its limit), inside fields a check walks into."""
    for depth in [200, 600, 900, *range(950, 1001), 5000]:
        r = _send(client, server, template.replace("%s", "[" * depth + "]" * depth))
        # 200 only for "unknown", ignored as SGLang ignores unknown keys.
        assert r.status_code in (200, 400), (depth, r.text)
        assert r.status_code == 200 or "error" in r.json()


@pytest.mark.parametrize("path", POST_PATHS)
@pytest.mark.parametrize("body", [[], "x", 3, None, [{"input_ids": [1]}]])
def test_non_object_bodies_get_400(server, client, path, body):
    r = client.post(f"{server.url}{path}", content=json.dumps(body))
    assert r.status_code == 400 and "must be a JSON object" in r.text, r.text


def test_body_over_the_limit_gets_413(server):
    big = b'{"input_ids": [' + b"1, " * (MAX_BODY_MB * 2**20 // 3 + 10) + b"1]}"
    status, _, body, sock = _raw(server, _post_bytes("/generate", big))
    sock.close()
    assert status == 413, body
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big)
    head = b"POST /update_weights_from_tensor HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    status, _, body, sock = _raw(server, head + chunked)
    sock.close()
    assert status == 413, body


def _contract_fields(struct, wanted) -> list[str]:
    """Fields of an SGLang contract struct whose annotation mentions `wanted` (e.g. "bool")."""
    hints = typing.get_type_hints(struct)
    return [
        name for name, hint in hints.items() if wanted in str(hint) or wanted in getattr(hint, "__name__", "")
    ]


def _sampling_fields(kind):
    return _contract_fields(contract.require().SamplingParams, kind)


def _request_fields(kind):
    return _contract_fields(contract.require().GenerateRequest, kind)


def _send(client, server, body_text: str):
    return client.post(
        f"{server.url}/generate", content=body_text, headers={"Content-Type": "application/json"}
    )


def _with_literal(body: dict, literal: str) -> str:
    """`body` as JSON text with the value "@" replaced by the raw JSON `literal` (NaN, 1e400, ...)."""
    return json.dumps(body).replace('"@"', literal)


def _assert_400_naming(response, field):
    assert response.status_code == 400, (field, response.status_code, response.text)
    assert field in json.dumps(response.json()), (field, response.text)


def test_every_boolean_field_refuses_non_booleans(server, client):
    sampling = _sampling_fields("bool")
    request = [f for f in _request_fields("Bool") + _request_fields("bool") if f not in sampling]
    request.append("return_routed_experts")  # not in SGLang's contract type, read by the server
    assert {"ignore_eos", "skip_special_tokens", "no_stop_trim"} <= set(sampling)
    assert {"return_logprob", "stream", "return_text_in_logprobs"} <= set(request)
    tried = 0
    for bad in ["no", 1, 0, "true", {}, 0.5]:
        for field in sampling:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, field: bad}}
            _assert_400_naming(_send(client, server, json.dumps(body)), f"sampling_params.{field}")
            tried += 1
        for field in set(request):
            _assert_400_naming(_send(client, server, json.dumps({"input_ids": PROMPT, field: bad})), field)
            tried += 1
    assert tried >= 6 * 10


INT_FIELDS_SAMPLING = ("max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed", "stream_interval")
INT_FIELDS_REQUEST = ("logprob_start_len", "top_logprobs_num", "routed_experts_start_len")


def test_every_integer_field_refuses_wrong_types_and_out_of_range(server, client):
    # The contract's int fields that the server reads are all covered here.
    assert set(INT_FIELDS_SAMPLING) <= set(_sampling_fields("int"))
    # Raw JSON literals (duplicate keys: the last one wins, so max_new_tokens is replaced too).
    literals = [
        '"3"',
        "1.5",
        "true",
        "[]",
        str(2**63),
        str(2**64),
        str(-(2**63) - 1),
        "NaN",
        "Infinity",
        "1e400",
    ]
    for literal in literals:
        for field in INT_FIELDS_SAMPLING:
            body = _with_literal(
                {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, field: "@"}}, literal
            )
            _assert_400_naming(_send(client, server, body), f"sampling_params.{field}")
        for field in INT_FIELDS_REQUEST:
            body = _with_literal({"input_ids": PROMPT, "return_logprob": True, field: "@"}, literal)
            _assert_400_naming(_send(client, server, body), field)
    # Range ends, each field at its first invalid value.
    for field, bad in [("max_new_tokens", -1), ("top_k", -2), ("top_k", 0), ("sampling_seed", -1),
                       ("sampling_seed", 2**63), ("n", 0), ("stream_interval", 0)]:  # fmt: skip
        body = {"input_ids": PROMPT, "sampling_params": {field: bad}}
        _assert_400_naming(_send(client, server, json.dumps(body)), f"sampling_params.{field}")
    for field, bad in [("logprob_start_len", -2), ("routed_experts_start_len", -1), ("top_logprobs_num", -1)]:
        _assert_400_naming(_send(client, server, json.dumps({"input_ids": PROMPT, field: bad})), field)
    ok = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "sampling_seed": 2**63 - 1}}
    assert _send(client, server, json.dumps(ok)).status_code == 200


FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


def test_every_float_field_refuses_nan_infinity_and_wrong_types(server, client):
    assert set(FLOAT_FIELDS) | {"logit_bias"} == set(_sampling_fields("float"))  # logit_bias: a dict
    _assert_400_naming(
        _send(
            client,
            server,
            _with_literal({"input_ids": PROMPT, "sampling_params": {"logit_bias": {"1": "@"}}}, "NaN"),
        ),
        "sampling_params.logit_bias",
    )
    for field in FLOAT_FIELDS:
        for literal in ["NaN", "Infinity", "-Infinity", "1e400", '"0.5"', "true", "[]", "null"]:
            body = _with_literal(
                {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, field: "@"}}, literal
            )
            r = _send(client, server, body)
            if literal == "null":  # SGLang's contract allows null: the default
                assert r.status_code == 200, (field, r.text)
            else:
                _assert_400_naming(r, f"sampling_params.{field}")
    for field, bad in [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.01),
                       ("frequency_penalty", 2.5), ("repetition_penalty", -1)]:  # fmt: skip
        body = {"input_ids": PROMPT, "sampling_params": {field: bad}}
        _assert_400_naming(_send(client, server, json.dumps(body)), f"sampling_params.{field}")


def test_malformed_rid_input_ids_text_and_sampling_params(server, client):
    batch = [PROMPT, PROMPT, PROMPT]
    cases = [
        ({"input_ids": PROMPT, "rid": 5}, "rid"),
        ({"input_ids": PROMPT, "rid": ["a"]}, "rid"),
        ({"input_ids": PROMPT, "rid": {"a": 1}}, "rid"),
        ({"input_ids": batch, "rid": ["a", "b"]}, "rid"),
        ({"input_ids": batch, "rid": ["a", "b", 3]}, "rid[2]"),
        ({"input_ids": batch, "rid": [None, ["x"], "c"]}, "rid[1]"),
        ({"input_ids": batch, "return_logprob": [True, "no", False]}, "return_logprob[1]"),
        (
            {"input_ids": batch, "sampling_params": [{}, {"temperature": "hot"}, {}]},
            "sampling_params[1].temperature",
        ),
        ({"input_ids": batch, "sampling_params": [{}, {}]}, "sampling_params"),
        ({"input_ids": PROMPT, "sampling_params": "greedy"}, "sampling_params"),
        ({"input_ids": [1, "2"]}, "input_ids[1]"),
        ({"input_ids": [1, True]}, "input_ids[1]"),
        ({"input_ids": [1, 2.0]}, "input_ids[1]"),
        ({"input_ids": [1, -3]}, "input_ids[1]"),
        ({"input_ids": [[1, 2], [3, [4]]]}, "input_ids[1][1]"),
        ({"input_ids": [[1, 2], 3]}, "input_ids[1]"),
        ({"input_ids": [[1, 2], []]}, "input_ids[1]"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": {"0": 1}}, "input_ids"),
        ({"input_ids": PROMPT, "sampling_params": {"stop_token_ids": [1, "x"]}}, "stop_token_ids[1]"),
        ({"input_ids": PROMPT, "sampling_params": {"stop_token_ids": 7}}, "stop_token_ids"),
        ({"text": "ж"}, "text"),
        ({"text": ["12", "1\u0000"]}, "text[1]"),
        ({"text": 12}, "text"),
        ({"text": []}, "text"),
    ]
    for body, field in cases:
        _assert_400_naming(_send(client, server, json.dumps(body)), field)
    # A lone surrogate escape is valid JSON but cannot be encoded by the tokenizer.
    _assert_400_naming(_send(client, server, '{"text": "12\\ud800"}'), "text")


def test_control_endpoints_check_their_fields(server, client):
    cases = [
        ("/update_weights_from_disk", {"model_path": "/x", "flush_cache": "no"}, "flush_cache"),
        ("/update_weights_from_disk", {"model_path": "/x", "abort_all_requests": 1}, "abort_all_requests"),
        ("/update_weights_from_disk", {"model_path": 5}, "model_path"),
        ("/update_weights_from_disk", {"model_path": "/x", "weight_version": [1]}, "weight_version"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": [], "flush_cache": 0}, "flush_cache"),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [], "abort_all_requests": "y"},
            "abort_all_requests",
        ),
        ("/update_weights_from_tensor", {"serialized_named_tensors": 5}, "serialized_named_tensors"),
        ("/abort_request", {"rid": 5}, "rid"),
        ("/abort_request", {"abort_all": "yes"}, "abort_all"),
        ("/pause_generation", {"mode": 3}, "mode"),
        ("/pause_generation", {"mode": "sleep"}, "mode"),
    ]
    for path, body, field in cases:
        r = client.post(f"{server.url}{path}", json=body)
        assert r.status_code == 400 and field in r.text, (path, body, r.status_code, r.text)
    assert client.get(f"{server.url}/health_generate").status_code == 200  # none of them paused it


def test_health_waits_out_a_pause_then_answers_503_as_sglang_does(server, client):
    """SGLang 0.5.23 serves /health and /health_generate with one handler (`health_generate`): it
    asks for one token, which a paused server holds, and answers 503 once its health timeout
    (SGLANG_HEALTH_CHECK_TIMEOUT) passes without scheduler output. /model_info answers at once."""
    for mode, path in (("in_place", "/health"), ("abort", "/health_generate")):
        assert client.post(f"{server.url}/pause_generation", json={"mode": mode}).status_code == 200
        try:
            start = time.monotonic()
            r = client.get(f"{server.url}{path}", timeout=HEALTH_WAIT_S * 20)  # a hang guard
            waited = time.monotonic() - start
            assert r.status_code == 503 and "generation is paused" in r.json()["message"], r.text
            assert waited >= HEALTH_WAIT_S - 0.1, waited  # not answered from the pause flag
            assert client.get(f"{server.url}/get_server_info").json()["num_pending_requests"] == 0
            assert client.get(f"{server.url}/model_info").status_code == 200  # alive, says so at once
        finally:
            client.post(f"{server.url}/continue_generation", json={})
        assert client.get(f"{server.url}{path}").status_code == 200


def test_health_generates_one_token_and_answers_200_once_a_pause_ends_within_its_wait(server, client):
    def tokens() -> int:
        return client.get(f"{server.url}/get_server_info").json()["num_generated_tokens"]

    def pending() -> int:
        return client.get(f"{server.url}/get_server_info").json()["num_pending_requests"]

    before = tokens()
    assert client.get(f"{server.url}/health").status_code == 200
    assert tokens() == before + 1  # SGLang's /health is a generation, not a flag
    assert client.post(f"{server.url}/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.get, f"{server.url}/health", timeout=HEALTH_WAIT_S * 20)
            deadline = time.monotonic() + 30  # a hang guard: the probe's row reaches the paused queue
            while pending() == 0:
                assert time.monotonic() < deadline and not answer.done()
                time.sleep(0.01)
            assert client.post(f"{server.url}/continue_generation", json={}).status_code == 200
            assert answer.result().status_code == 200  # its token came within the wait
    finally:
        client.post(f"{server.url}/continue_generation", json={})


def test_unknown_path_and_method(server, client):
    assert client.get(f"{server.url}/nope").status_code == 404
    assert client.get(f"{server.url}/generate").status_code == 405
    assert client.post(f"{server.url}/health").status_code == 405


def test_64_concurrent_fresh_connections_500_requests_no_errors(server):
    host, port = _address(server)
    paths = ["/health", "/get_model_info"]

    def one(i: int) -> int:
        conn = http.client.HTTPConnection(host, port, timeout=30)  # a fresh connection each time
        try:
            conn.request("GET", paths[i % 2])
            response = conn.getresponse()
            response.read()
            return response.status
        finally:
            conn.close()

    start = time.monotonic()
    with cf.ThreadPoolExecutor(64) as pool:
        futures = [pool.submit(one, i) for i in range(500)]
        errors = [repr(f.exception()) for f in futures if f.exception() is not None]
        statuses = [f.result() for f in futures if f.exception() is None]
    elapsed = time.monotonic() - start
    assert not errors, f"{len(errors)} errors, e.g. {errors[:3]}"
    assert statuses == [200] * 500
    print(f"500 requests over fresh connections, 64 at once: {elapsed:.2f} s, {500 / elapsed:.0f} req/s")


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss")
def test_listen_backlog_is_large(server):
    """Resets under a burst of connections come from a small backlog (the stdlib server's was 5)."""
    _, port = _address(server)
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True)
    backlogs = [int(line.split()[2]) for line in out.stdout.splitlines() if line.startswith("LISTEN")]
    assert backlogs and min(backlogs) >= 1024, out.stdout


@pytest.mark.parametrize("n", [MAX_BATCH + 4, MAX_BATCH + 32 + 12])
def test_concurrent_generate_requests_wait_together_and_control_calls_still_run(server, client, n):
    """Each /generate waits in a pool thread, side by side in the batcher's queue; with more
    waiting calls than generation threads, /continue_generation (control pool) still runs."""
    assert client.post(f"{server.url}/pause_generation", json={"mode": "in_place"}).status_code == 200
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    with cf.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(httpx.post, f"{server.url}/generate", json=body, timeout=60) for _ in range(n)]
        try:
            expect = min(n, MAX_BATCH + 32)  # the rest wait for a generation thread
            deadline = time.monotonic() + 20
            pending = 0
            while time.monotonic() < deadline and pending < expect:
                pending = client.get(f"{server.url}/get_server_info").json()["num_pending_requests"]
                time.sleep(0.05)
            assert pending == expect
        finally:
            r = client.post(f"{server.url}/continue_generation", json={}, timeout=10)
        assert r.status_code == 200
        answers = [f.result() for f in futures]
    assert all(a.status_code == 200 and len(a.json()["output_ids"]) == 3 for a in answers)


NASTY = ["NaN", "-Infinity", "1e400", "-1", "0", "1", "2", "-9223372036854775809", "9223372036854775808",
         "0.5", "true", "false", "null", '""', '"x"', '"\\ud800"', "[]", "[1]", '["a"]', "[[1]]", "{}",
         '{"a": 1}', "[null]", "[true, false]"]  # fmt: skip


def test_any_value_in_any_field_gets_200_or_a_400_never_a_500(server, client):
    """Deterministic sweep: every field SGLang's contract knows, each with every nasty JSON value."""
    api = contract.require()
    top = [f for f in typing.get_type_hints(api.GenerateRequest) if f not in ("input_ids", "text")]
    sampling = list(typing.get_type_hints(api.SamplingParams))
    statuses = {}
    for literal in NASTY:
        for field in top + ["return_routed_experts"]:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, field: "@"}
            r = _send(client, server, _with_literal(body, literal))
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400), (field, literal, r.status_code, r.text)
            assert r.status_code == 200 or len(r.text) > 20
        for field in sampling:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, field: "@"}}
            r = _send(client, server, _with_literal(body, literal))
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400), (field, literal, r.status_code, r.text)
    print(f"field x value sweep: {statuses}")
    assert statuses.get(200, 0) > 50 and statuses.get(400, 0) > 500  # both outcomes really happen


def test_any_value_in_any_control_field_gets_200_or_a_400_never_a_500(server, client):
    update = ["load_format", "weight_version", "flush_cache", "abort_all_requests"]
    endpoints = {
        "/update_weights_from_disk": ({"model_path": "/nonexistent"}, ["model_path", *update]),
        "/update_weights_from_tensor": (
            {"serialized_named_tensors": ""},
            ["serialized_named_tensors", *update],
        ),
        "/abort_request": ({}, ["rid", "abort_all"]),
        "/pause_generation": ({}, ["mode"]),
    }
    try:
        for path, (base, fields) in endpoints.items():
            for field in fields:
                for literal in NASTY:
                    r = client.post(
                        f"{server.url}{path}", content=_with_literal({**base, field: "@"}, literal)
                    )
                    assert r.status_code in (200, 400), (path, field, literal, r.status_code, r.text)
    finally:
        client.post(f"{server.url}/continue_generation", json={})
    assert client.get(f"{server.url}/health_generate").status_code == 200


def test_an_http2_preface_gets_400_and_one_log_line_not_a_traceback(tmp_path):
    """SGLang's router probes each worker it registers over gRPC (HTTP/2) too."""
    ckpt = make_tiny_hf_checkpoint(tmp_path / "m", CFG, seed=0)
    with launch_embedded_server(ckpt, extra_args=["--log-level", "info"]) as srv:
        status, _, _, sock = _raw(srv, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        sock.close()
        deadline = time.monotonic() + 30  # a hang guard: the line is logged as the 400 goes out
        while "answered 400 to an HTTP/2 connection" not in srv.output:
            assert time.monotonic() < deadline, srv.output
            time.sleep(0.05)
        assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
        output = srv.output
    assert status == 400
    assert "Traceback" not in output and "Error handling request" not in output, output
