"""The embedded server against real SGLang 0.5.23, endpoint by endpoint (docs/sglang-conformance.md).

One SGLang server (its CPU engine, launch/setup_sglang.sh) and one embedded server serve the same
fp32 tiny Qwen3-MoE for the whole module. Each case runs against both: where the two must agree
it asserts the same answer from each, checked against an independent reference where there is one
(transformers' forward, the router's top-k); where they differ by design it asserts the
documented difference. The weight syncs come last: they change what both serve.
"""

import base64
import concurrent.futures as cf
import time

import httpx
import numpy as np
import pytest
import torch
from served import served_logprobs
from world_one import world_one_policy

from megatron_gspo.config import WeightSyncConfig
from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.convert import random_tokens
from megatron_gspo.model.logprobs import sequence_logprobs
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.requests import build_generate_request
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.rollout.sglang_launch import launch_sglang_server, sglang_unavailable
from megatron_gspo.weight_sync.sync import WeightSync

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sglang_unavailable() is not None, reason=str(sglang_unavailable())),
]

CFG = tiny(vocab_size=80, init_std=0.2)
TOKENS = random_tokens(CFG.vocab_size, batch=2, length=16, seed=3)
PROMPTS = [[1, 11, 12, 13, 14], [1, 30, 31], [1, 5, 6, 7, 8, 9, 10]]
HEALTH_TIMEOUT_S = "3"  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT (20 s by default): /health under a pause
ENGINES = ["embedded", "sglang"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    env = {"SGLANG_HEALTH_CHECK_TIMEOUT": HEALTH_TIMEOUT_S}
    with world_one_policy(tmp_path_factory.mktemp("hf"), CFG, seed=3) as (model, checkpoint):
        with cf.ThreadPoolExecutor(1) as pool:  # SGLang's start (~35 s) beside the embedded one's
            real = pool.submit(
                launch_sglang_server,
                checkpoint,
                log_path=tmp_path_factory.mktemp("sglang") / "server.log",
                extra_args=["--dtype", "float32", "--enable-return-routed-experts", "--skip-server-warmup"],
                env=env,
            )
            embedded = launch_embedded_server(checkpoint, env=env)
            servers = {"embedded": embedded, "sglang": real.result()}
        clients = {name: SGLangClient([server.url], max_retries=0) for name, server in servers.items()}
        yield model, checkpoint, servers, clients, tmp_path_factory.mktemp("export")
        for client in clients.values():
            client.close()
        servers["sglang"].stop()
        embedded.terminate()


def post(url: str, path: str, body: dict | None = None, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + path, json=body or {}, timeout=timeout)


def generate(url: str, ids: list[int], *, max_new_tokens: int = 6, **extra) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        **extra,
    }
    answer = post(url, "/generate", body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def hf_reference(checkpoint, ids: list[int]):
    """transformers' fp32 log-probs [T, V] and router top-k [T, L, k] of `ids`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    logprobs = torch.log_softmax(out.logits[0].double(), -1)
    k = model.config.num_experts_per_tok
    routes = torch.stack([r.view(len(ids), -1).topk(k, -1).indices for r in out.router_logits], 1)
    return logprobs, routes


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_and_logprobs_agree_with_transformers(setup, prompt):
    _, checkpoint, servers, _, _ = setup
    answers = {name: generate(s.url, prompt) for name, s in servers.items()}
    out = answers["sglang"]["output_ids"]
    assert answers["embedded"]["output_ids"] == out
    reference, _ = hf_reference(checkpoint, prompt + out)
    expected = [float(reference[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]
    assert out == [int(reference[len(prompt) - 1 + i].argmax()) for i in range(len(out))]
    for answer in answers.values():
        served = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
        assert np.allclose(served, expected, atol=1e-3), (served, expected)
        assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


@pytest.mark.parametrize("start", [0, 3])
def test_routed_experts_layout_and_routes_agree_with_the_router(setup, start):
    """Rows cover positions [start, T - 1), layers x top-k, little-endian int32 (sglang-api.md)."""
    _, checkpoint, servers, _, _ = setup
    prompt = PROMPTS[2]
    for name, server in servers.items():
        answer = generate(server.url, prompt, return_routed_experts=True, routed_experts_start_len=start)
        full = prompt + answer["output_ids"]
        raw = np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), dtype="<i4")
        routes = raw.reshape(len(full) - 1 - start, CFG.num_layers, CFG.moe_topk)
        _, reference = hf_reference(checkpoint, full)
        same = np.sort(routes, -1) == np.sort(reference[start : len(full) - 1].numpy(), -1)
        assert same.mean() > 0.99, (name, same.mean())


@pytest.mark.parametrize("engine", ENGINES)
def test_an_unknown_sampling_param_is_a_400_naming_it(setup, engine):
    url = setup[2][engine].url
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "no_such_param": 1}}
    answer = post(url, "/generate", body)
    assert answer.status_code == 400 and "no_such_param" in answer.text


@pytest.mark.parametrize("engine", ENGINES)
def test_health_blocks_while_paused_and_answers_once_continued(setup, engine):
    url = setup[2][engine].url
    assert post(url, "/pause_generation", {"mode": "retract"}).status_code == 200
    try:
        paused = httpx.get(url + "/health", timeout=60)
        ready = httpx.get(url + "/ready", timeout=60)
    finally:
        assert post(url, "/continue_generation").status_code == 200
    assert paused.status_code == 503 and ready.status_code == 503
    assert httpx.get(url + "/health", timeout=60).status_code == 200


@pytest.mark.parametrize("engine", ENGINES)
def test_abort_all_ends_a_request_in_flight_with_finish_reason_abort(setup, engine):
    url = setup[2][engine].url
    with cf.ThreadPoolExecutor(1) as pool:
        long = pool.submit(generate, url, PROMPTS[0], max_new_tokens=400)
        time.sleep(1.0)  # the request is decoding (400 tokens take several seconds on either)
        assert post(url, "/abort_request", {"abort_all": True}).status_code == 200
        answer = long.result(60)
    meta = answer["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 400


def generate_rows(url: str, rows: int, max_new_tokens: int) -> list[dict]:
    body = {
        "input_ids": [PROMPTS[i % len(PROMPTS)] for i in range(rows)],
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True},
    }
    answer = post(url, "/generate", body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_pause_mid_generation_in_each_mode(setup, engine, mode):
    """abort ends the rows in flight (finish reason abort); retract and in_place hold them, and once
    continued they finish at full length (SGLang: io_struct.PauseGenerationReqInput)."""
    url, rows, tokens = setup[2][engine].url, 8, 480  # 8 x 487 tokens: inside the 4096-token KV pool
    with cf.ThreadPoolExecutor(1) as pool:
        batch = pool.submit(generate_rows, url, rows, tokens)
        time.sleep(0.5)  # the rows are decoding: 3,840 tokens take seconds on either server
        assert post(url, "/pause_generation", {"mode": mode}).status_code == 200
        time.sleep(0.5)
        held = not batch.done()
        assert post(url, "/continue_generation").status_code == 200
        answers = batch.result(300)
    reasons = {a["meta_info"]["finish_reason"]["type"] for a in answers}
    if mode == "abort":
        assert reasons == {"abort"} and all(a["meta_info"]["completion_tokens"] < tokens for a in answers)
    else:
        assert held and reasons == {"length"}
        assert [a["meta_info"]["completion_tokens"] for a in answers] == [tokens] * rows


@pytest.mark.parametrize("engine", ENGINES)
def test_flush_cache_is_refused_under_an_in_place_pause_with_rows_held(setup, engine):
    url = setup[2][engine].url
    with cf.ThreadPoolExecutor(1) as pool:
        batch = pool.submit(generate_rows, url, 8, 480)
        time.sleep(0.5)
        assert post(url, "/pause_generation", {"mode": "in_place"}).status_code == 200
        try:
            refused = post(url, "/flush_cache")
        finally:
            assert post(url, "/continue_generation").status_code == 200
        batch.result(300)
    assert refused.status_code == 400


@pytest.mark.parametrize("engine", ENGINES)
def test_update_weights_from_tensor_outside_a_session_is_refused(setup, engine):
    answer = post(setup[2][engine].url, "/update_weights_from_tensor", {"serialized_named_tensors": []})
    assert answer.status_code == 400


@pytest.mark.parametrize("engine", ENGINES)
def test_retired_endpoints_are_404(setup, engine):
    url = setup[2][engine].url
    assert httpx.get(url + "/get_weight_version", timeout=30).status_code == 404


@pytest.mark.parametrize("engine", ENGINES)
def test_flush_cache_when_idle(setup, engine):
    assert post(setup[2][engine].url, "/flush_cache").status_code == 200


def test_release_without_the_memory_saver_differs_by_design(setup):
    """SGLang answers 200 and frees nothing (its no-op adapter); the embedded server refuses by name,
    so a colocated run that forgot the flag fails at once instead of running beside full memory."""
    servers = setup[2]
    real = post(servers["sglang"].url, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert real.status_code == 200
    assert post(servers["sglang"].url, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    embedded = post(servers["embedded"].url, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert embedded.status_code == 400 and "MemorySaverDisabled" in embedded.text


def test_update_weights_from_disk_moves_the_live_version_not_the_launch_one(setup):
    _, checkpoint, servers, clients, _ = setup
    for name, server in servers.items():
        launch_version = clients[name].server_info()[0]["weight_version"]
        body = {"model_path": str(checkpoint), "weight_version": "disk-7", "flush_cache": True}
        answer = post(server.url, "/update_weights_from_disk", body, timeout=120)
        assert answer.status_code == 200 and answer.json()["success"], (name, answer.text)
        assert clients[name].model_info()[0]["weight_version"] == "disk-7"
        assert clients[name].server_info()[0]["weight_version"] == launch_version


def trainer_logprobs(model) -> torch.Tensor:
    ours, _ = sequence_logprobs(model, list(TOKENS))
    return ours.double()[:, 1:]


@pytest.mark.parametrize("method", ["distributed", "tensor", "disk"])
def test_weight_sync_serves_the_trainer_weights_on_both(setup, method):
    """The trainer's WeightSync into each server (distributed: SGLang's own update group, gloo)."""
    model, _, _, clients, export_dir = setup
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.05)
    version = {"distributed": 21, "tensor": 22, "disk": 23}[method]
    for name, client in clients.items():
        before = served_logprobs(client, TOKENS)
        assert (before - trainer_logprobs(model)).abs().max() > 1e-3  # the sync has something to show
        cfg = WeightSyncConfig(method=method, bucket_mb=0.05, timeout_s=120)
        sync = WeightSync(cfg, model, CFG, export_dir / name)
        stats = sync.sync(client, version)
        sync.close(client)
        assert stats.attempts == 1, name
        assert client.model_info()[0]["weight_version"] == str(version)
        gap = (served_logprobs(client, TOKENS) - trainer_logprobs(model)).abs().max()
        assert gap <= 1e-4, (name, float(gap))


def test_an_out_of_vocabulary_prompt_kills_sglang_so_the_trainer_refuses_it_before_sending(setup):
    """Last in the module: it ends the SGLang server. SGLang does not check prompt ids against the
    vocabulary: one inside its padded embedding (a multiple of 64 rows) is served from a padding
    row, silently; one beyond raises IndexError in its scheduler, and the server exits. The embedded
    server refuses both with a 400, so the trainer must not rely on the server: it refuses such a
    prompt itself (`build_generate_request(vocab_size=...)`)."""
    servers = setup[2]
    padded, beyond = CFG.vocab_size + 3, 500

    def body(token: int) -> dict:
        return {"input_ids": [1, token, 5], "sampling_params": {"max_new_tokens": 2}}

    for token in (padded, beyond):
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            build_generate_request(body(token)["input_ids"], {}, vocab_size=CFG.vocab_size)
        embedded = post(servers["embedded"].url, "/generate", body(token))
        assert embedded.status_code == 400 and "outside [0, 80)" in embedded.text
    assert post(servers["sglang"].url, "/generate", body(padded)).status_code == 200
    with pytest.raises(httpx.TransportError):  # dropped, or never answered: the scheduler died
        post(servers["sglang"].url, "/generate", body(beyond), timeout=10)
    deadline = time.monotonic() + 60  # the scheduler is gone; the HTTP server follows it down
    while time.monotonic() < deadline:
        try:
            httpx.get(servers["sglang"].url + "/model_info", timeout=5)
        except httpx.TransportError:
            return
        time.sleep(0.5)
    pytest.fail("SGLang still answers after its scheduler died")
