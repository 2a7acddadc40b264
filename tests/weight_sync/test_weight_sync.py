"""Weight sync into a real embedded server: the protocol, faults and retries (a world of one).

Faults are injected at the HTTP boundary by a forwarding proxy that answers one chosen
request with 503 instead of passing it on, as a dying server or a broken link would.
"""

import concurrent.futures as cf
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
from served import served_logprobs
from world_one import world_one_policy

from megatron_gspo.config import WeightSyncConfig
from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.convert import random_tokens
from megatron_gspo.model.hf.stream import NonFiniteWeightError
from megatron_gspo.model.logprobs import sequence_logprobs
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.weight_sync import distributed
from megatron_gspo.weight_sync.sync import WeightSync, WeightSyncFailed

CFG = tiny(vocab_size=80, init_std=0.2)
TOKENS = random_tokens(CFG.vocab_size, batch=2, length=16, seed=3)


class FaultyProxy:
    """Forwards every request to `target`; answers POSTs `at`..`at + times - 1` to `path` with `status`,
    or (`hang`) holds the `at`-th unanswered and unforwarded until `release` is set, as a hung server."""

    def __init__(self, target: str):
        self.target, self.fail_path, self.fail_at, self.seen = target, None, 0, 0
        self.status, self.times = 503, 1
        self.hang, self.release, self.hang_over = False, threading.Event(), False
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if method == "POST" and self.path == proxy.fail_path:
                    proxy.seen += 1
                    if proxy.seen == proxy.fail_at and proxy.hang:
                        proxy.release.wait(60)
                        proxy.hang_over = True
                        self._answer(503, b'{"error": "released"}')
                        return
                    if proxy.fail_at <= proxy.seen < proxy.fail_at + proxy.times:
                        self._answer(proxy.status, b'{"error": "injected fault"}')
                        return
                answer = httpx.request(method, proxy.target + self.path, content=body, timeout=120)
                self._answer(answer.status_code, answer.content)

            def _answer(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fail_once(self, path: str, at: int, *, status: int = 503, times: int = 1, hang: bool = False) -> None:
        self.fail_path, self.fail_at, self.seen, self.status, self.times = path, at, 0, status, times
        self.hang = hang
        self.release.clear()
        self.hang_over = False


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with world_one_policy(tmp_path_factory.mktemp("hf"), CFG, seed=3) as (model, checkpoint):
        server = launch_embedded_server(checkpoint)
        proxy = FaultyProxy(server.url)
        client = SGLangClient([proxy.url], max_retries=0)
        yield model, client, proxy, server, tmp_path_factory.mktemp("export")
        client.close()
        proxy.server.shutdown()
        server.terminate()


def trainer_logprobs(model) -> torch.Tensor:
    ours, _ = sequence_logprobs(model, list(TOKENS))
    return ours.double()[:, 1:]


def served_version(client: SGLangClient) -> str:
    return client.model_info()[0]["weight_version"]


def perturb(model, scale: float) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(scale)


def make_sync(model, export_dir, **overrides) -> WeightSync:
    cfg = WeightSyncConfig(**{"bucket_mb": 0.05, "timeout_s": 60, **overrides})
    return WeightSync(cfg, model, CFG, export_dir)


def test_failed_bucket_leaves_a_partial_update_under_the_old_version_then_retry_succeeds(setup):
    """As SGLang: the buckets before a failed one are loaded (SGLang: "partially updated"), the
    version keeps its old label; the retry sends every bucket and serves the trainer's weights."""
    model, client, proxy, _, export_dir = setup
    perturb(model, 1.1)
    old, old_version = served_logprobs(client, TOKENS), served_version(client)
    assert (old - trainer_logprobs(model)).abs().max() > 1e-2  # the sync below has something to show

    sync = make_sync(model, export_dir, retries=0)
    proxy.fail_once("/update_weights_from_distributed", at=3)
    with pytest.raises(WeightSyncFailed) as err:
        sync.sync(client, 7)
    message = str(err.value)
    assert "bucket 2" in message and proxy.url in message and "injected fault" in message
    assert served_version(client) == old_version  # the version rides on the last bucket
    partial = served_logprobs(client, TOKENS)  # buckets 0-1 loaded, the rest old: neither model
    assert (partial - old).abs().max() > 1e-3 and (partial - trainer_logprobs(model)).abs().max() > 1e-3

    sync = make_sync(model, export_dir, retries=1)
    proxy.fail_once("/update_weights_from_distributed", at=2)
    stats = sync.sync(client, 7)
    sync.close(client)
    assert stats.attempts == 2 and stats.buckets > 3
    assert served_version(client) == "7"
    assert (served_logprobs(client, TOKENS) - trainer_logprobs(model)).abs().max() <= 1e-5


def test_a_hung_server_times_out_and_the_retry_serves_the_weights(setup, monkeypatch):
    """The timeout path: the first bucket's announcement never reaches the server (it hangs);
    the attempt ends at weight_sync.timeout_s, long before the hang would, and the retry succeeds.
    At the deadline rank 0 aborts its side of the group at once (under NCCL, before torch's
    watchdog would end the trainer at the group's longer timeout), before the servers are
    asked to leave it; the aborted group is not destroyed again."""
    model, client, proxy, _, export_dir = setup
    perturb(model, 1.05)
    old_version = served_version(client)
    sync = make_sync(model, export_dir, retries=1, timeout_s=2.0)
    events = []

    def abort(group, real=distributed.abort_update_group):
        events.append(("abort", sync._group.name, proxy.hang_over))
        real(group)

    def set_aside(name, timeout_s, real=client.set_aside_held_workers):
        events.append(("set aside", name, proxy.hang_over))
        return real(name, timeout_s)

    destroyed = []
    monkeypatch.setattr(distributed, "abort_update_group", abort)
    monkeypatch.setattr(distributed, "destroy_update_group", lambda group: destroyed.append(group))
    monkeypatch.setattr(client, "set_aside_held_workers", set_aside)
    proxy.fail_once("/update_weights_from_distributed", at=1, hang=True)
    try:
        stats = sync.sync(client, 11)
        still_hung = not proxy.hang_over  # the attempt was ended by the timeout, not by the hang
    finally:
        proxy.release.set()
    first = events[0][1]
    sync.close(client)
    assert still_hung and stats.attempts == 2
    assert events[:2] == [
        ("abort", first, False),
        ("set aside", first, False),
    ]  # abort first, at the deadline
    assert [e[0] for e in events[2:]] == ["set aside"] and events[2][1] != first  # close: the retry's group
    assert len(destroyed) == 1  # the retry's group only: the aborted one is gone
    assert old_version != "11" and served_version(client) == "11"
    assert (served_logprobs(client, TOKENS) - trainer_logprobs(model)).abs().max() <= 1e-5


def test_the_embedded_server_reports_its_device(setup):
    _, client, _, _, _ = setup
    assert client.server_info()[0]["device"] == "cpu"  # as SGLang's launch argument: `auto` reads it


def test_nccl_refused_by_a_cpu_server_ends_the_join_at_once_naming_its_reason(setup):
    """The server refuses an NCCL group at once; the trainer's rendezvous would wait for it until
    its own timeout (31 s here before the join watched the server's answer)."""
    model, client, _, _, export_dir = setup
    sync = make_sync(model, export_dir, backend="nccl", retries=0, timeout_s=30)
    start = time.monotonic()
    with pytest.raises(WeightSyncFailed, match="needs a CUDA device; this server runs on the CPU"):
        sync.sync(client, 13)
    assert time.monotonic() - start < 5.0
    make_sync(model, export_dir).sync(client, 14)  # the refusal left nothing behind
    assert served_version(client) == "14"


@pytest.mark.parametrize("method", ["tensor", "disk"])
def test_tensor_and_disk_methods_serve_the_trainer_weights(setup, method):
    model, client, _, _, export_dir = setup
    perturb(model, 0.95)
    version = {"tensor": 8, "disk": 9}[method]
    stats = make_sync(model, export_dir, method=method).sync(client, version)
    assert stats.attempts == 1
    assert served_version(client) == str(version)
    assert (served_logprobs(client, TOKENS) - trainer_logprobs(model)).abs().max() <= 1e-5


def test_a_nonfinite_weight_is_never_sent(setup):
    model, client, _, _, export_dir = setup
    before, version = served_logprobs(client, TOKENS), served_version(client)
    param = next(p for n, p in model.named_parameters() if "linear_fc2" in n)
    saved = param.detach().clone()
    with torch.no_grad():
        param[0, 0] = float("nan")
    try:
        with pytest.raises(NonFiniteWeightError, match=r"sync weights .*linear_fc2.weight has NaN/inf"):
            make_sync(model, export_dir, retries=2).sync(client, 99)
    finally:
        with torch.no_grad():
            param.copy_(saved)
    assert served_version(client) == version
    assert torch.equal(served_logprobs(client, TOKENS), before)


def test_protocol_misuse_gets_400_naming_the_problem(setup):
    _, _, _, server, _ = setup
    with httpx.Client(base_url=server.url, timeout=30) as http:

        def post(path, body):
            answer = http.post(path, json=body)
            assert answer.status_code == 400, (path, answer.text)
            return answer.json()["message"]

        shape = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]]}
        assert "not initialised" in post("/update_weights_from_distributed", {**shape, "group_name": "nope"})
        assert "no weight-update session" in post("/end_weight_update", {})
        assert http.post("/begin_weight_update", json={}).status_code == 200
        assert "already open" in post("/begin_weight_update", {})
        assert http.post("/end_weight_update", json={"abort": True}).status_code == 200
        assert "names must be a list" in post("/update_weights_from_distributed", {**shape, "names": "x"})
        assert "master_port is required" in post(
            "/init_weights_update_group", {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2}
        )
        base = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}
        assert "backend='mpi' unsupported" in post(
            "/init_weights_update_group", {**base, "rank_offset": 1, "backend": "mpi"}
        )
        assert "needs a CUDA device" in post(
            "/init_weights_update_group", {**base, "rank_offset": 1, "backend": "nccl"}
        )
        assert "rank_offset=0" in post(
            "/init_weights_update_group", {**base, "rank_offset": 0, "backend": "gloo"}
        )
        assert "does not exist" in post("/destroy_weights_update_group", {"group_name": "nope"})


@pytest.mark.parametrize("refusals", [1, 10])
def test_flush_cache_refused_while_requests_run_does_not_fail_the_sync(setup, monkeypatch, caplog, refusals):
    """SGLang answers /flush_cache with 400 while requests run; the weights are in place regardless."""
    model, client, proxy, _, export_dir = setup
    monkeypatch.setattr("megatron_gspo.weight_sync.session.FLUSH_BACKOFF_S", 0.01)
    perturb(model, 1.02)
    version = 20 + refusals
    proxy.fail_once("/flush_cache", at=1, status=400, times=refusals)
    stats = make_sync(model, export_dir, method="tensor", retries=0).sync(client, version)
    assert stats.attempts == 1 and served_version(client) == str(version)
    assert (served_logprobs(client, TOKENS) - trainer_logprobs(model)).abs().max() <= 1e-5
    flushed = refusals < 4  # waited out within the attempts, else skipped with a warning
    assert stats.metrics()["sync/cache_flushed"] == float(flushed)
    assert ("kept refusing /flush_cache" in caplog.text) is not flushed
    proxy.fail_once(None, at=0)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_sync_inside_a_pause_asks_for_the_flush_only_as_often_as_sglang_can_grant_it(setup, mode):
    """An `in_place` pause holds the running request, so SGLang refuses /flush_cache until generation
    continues: asked once, not waited out (4 refusals and 1.75 s of backoff a sync). A `retract`
    pause moves it back to the waiting queue, which a paused SGLang ignores: flushed at once."""
    model, client, proxy, server, export_dir = setup
    rid, version = f"held-{mode}", 40 if mode == "in_place" else 41
    body = {
        "input_ids": TOKENS[0].tolist(),
        "rid": rid,
        "sampling_params": {"max_new_tokens": 480, "ignore_eos": True},  # far from done when paused
    }
    before = server.generated_tokens()
    held = cf.ThreadPoolExecutor(1).submit(httpx.post, f"{server.url}/generate", json=body, timeout=120)
    server.wait_for_tokens(before + 1)
    proxy.fail_once("/flush_cache", at=0)  # counts the calls, fails none
    client.pause_generation(mode)
    try:
        assert client.server_info()[0]["num_pending_requests"] == 1  # held through the sync
        perturb(model, 1.01)
        stats = make_sync(model, export_dir, method="tensor", retries=0).sync(client, version)
    finally:
        httpx.post(f"{server.url}/abort_request", json={"rid": rid})  # ends the hold: no need to finish
        client.continue_generation()
    assert held.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert served_version(client) == str(version)
    assert (proxy.seen, stats.metrics()["sync/cache_flushed"]) == (1, float(mode == "retract"))
    assert client.flush_cache()  # idle again: granted
    proxy.fail_once(None, at=0)
