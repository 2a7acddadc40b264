"""Rollout fleets behind SGLang's real router (pip `sglang-router`) in front of embedded servers.

The client finds the workers at the router's GET /workers, sends /generate through the router
and weight sync / version checks to every worker; a worker lost mid-batch is retried elsewhere
by the router, one lost mid-sync is removed and the rest are synced (or the run stops by name
below rollout.min_workers).
"""

from __future__ import annotations

import os
import socket
import subprocess

import httpx
import pytest
from warm_python import kill_server, python

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.rollout import (
    SGLangClient,
    StaleRolloutError,
    build_generate_request,
    parse_generate_response,
)
from megatron_gspo.rollout.fleet import FleetTooSmallError
from megatron_gspo.rollout.router_launch import launch_router, router_available
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.rollout.server_checks import served_weights
from megatron_gspo.rollout.types import RolloutBatch
from megatron_gspo.tasks.tokenizer import build_char_tokenizer
from megatron_gspo.training.metrics import read_metrics

pytestmark = [
    pytest.mark.skipif(router_available() is not None, reason=str(router_available())),
    pytest.mark.slow,  # two servers and a router per test (~30 s on 2 shared cores)
]

TOKENIZER = build_char_tokenizer()
CFG = tiny(vocab_size=len(TOKENIZER))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("fleet") / "tiny", CFG, TOKENIZER)


def requests_for(prompts, group):
    return [
        build_generate_request(
            TOKENIZER.encode(p),
            {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": j, "ignore_eos": True},
            rid=f"{g}-{j}",
        )
        for g, p in enumerate(prompts)
        for j in range(group)
    ]


def to_batch(requests, responses, group, version):
    samples = []
    for i, (request, response) in enumerate(zip(requests, responses)):
        sample = parse_generate_response(request["input_ids"], response, vocab_size=len(TOKENIZER))
        sample.group_index = i // group
        samples.append(sample)
    return RolloutBatch.from_samples(samples, group, expected_weight_version=version)


def test_client_finds_the_workers_generates_through_the_router_and_checks_versions(checkpoint):
    with (
        launch_embedded_server(checkpoint, extra_args=["--weight-version", "3"]) as a,
        launch_embedded_server(checkpoint, extra_args=["--weight-version", "3"]) as b,
        launch_router([a.url, b.url]) as router,
        SGLangClient([], router_url=router.url, max_retries=1, backoff_s=0.05) as client,
    ):
        assert client.urls == sorted([a.url, b.url])  # from GET /workers, not configured
        client.wait_until_healthy(30)
        requests = requests_for(["12+34=", "5+6=", "7+8="], group=4)
        responses = client.generate_batched(requests)
        batch = to_batch(requests, responses, 4, "3")
        assert batch.num_groups == 3 and batch.response_mask.sum().item() == 12 * 6
        # The same rows sent straight to one worker give the same tokens and log-probs (seeded).
        with SGLangClient([a.url]) as direct:
            again = direct.generate_batched(requests)
        assert [r["output_ids"] for r in responses] == [r["output_ids"] for r in again]
        # Control calls reach every worker the router lists: both answer version 4 afterwards.
        client.update_weights_from_disk(str(checkpoint), weight_version="4")
        assert [v for _, v, _ in served_weights(client.urls, client.model_info())] == ["4", "4"]
        # One worker left behind (an update it missed): its responses are refused by version.
        httpx.post(
            f"{b.url}/update_weights_from_disk", json={"model_path": str(checkpoint), "weight_version": "3"}
        )
        with pytest.raises(StaleRolloutError):
            for _ in range(4):  # cache-aware routing may keep a prompt on one worker: vary prompts
                requests = requests_for(["1+1=", "22+3=", "9+9=", "40+2="], group=2)
                to_batch(requests, client.generate_batched(requests), 2, "4")


def test_worker_lost_mid_batch_is_retried_by_the_router(checkpoint):
    with (
        launch_embedded_server(checkpoint) as a,
        launch_embedded_server(checkpoint) as b,
        launch_router([a.url, b.url]) as router,
        SGLangClient([], router_url=router.url, max_retries=0) as client,
    ):
        requests = requests_for([f"{i}+{i}=" for i in range(8)], group=2)
        for r in requests:
            r["sampling_params"]["max_new_tokens"] = 40
        future = client._background.submit(client.generate_batched, requests)
        while httpx.get(f"{b.url}/get_server_info").json()["num_pending_requests"] == 0:
            assert not future.done(), "the batch ended before the router sent any of it to worker b"
        kill_server(b)  # with requests of the batch on it
        responses = future.result(timeout=120)
        assert len(responses) == len(requests) and all(len(r["output_ids"]) == 40 for r in responses)
        assert client.remove_unhealthy_workers() == [b.url]
        assert client.urls == [a.url] and client.fleet.metrics() == {
            "fleet/workers": 1.0,
            "fleet/removed": 1.0,
            "fleet/rejoined": 0.0,
        }
        client.min_workers = 2
        kill_server(a)
        with pytest.raises(
            FleetTooSmallError, match=r"0 healthy rollout worker\(s\) left behind .*min_workers=2"
        ):
            client.remove_unhealthy_workers()


def test_train_three_steps_behind_the_router(checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    with (
        launch_embedded_server(checkpoint) as a,
        launch_embedded_server(checkpoint) as b,
        launch_router([a.url, b.url]) as router,
    ):
        config = tmp_path / "run.yaml"
        config.write_text(
            f"model: {{hf_path: {checkpoint}}}\n"
            "task: {name: addition, options: {min_digits: 1, max_digits: 2, format_reward: 0.5}}\n"
            "sft: {steps: 0}\n"
            f"rollout: {{rollout_batch_size: 4, group_size: 4, max_new_tokens: 4, temperature: 1.0,\n"
            f"          router_url: '{router.url}'}}\n"
            "algorithm: {num_mini_batches: 1}\n"
            "eval: {at_start: false, at_end: false, every: 0}\n"
            f"trainer: {{steps: 3, run_dir: {run_dir}}}\n"
            "logging: {progress_bar: false}\n"
        )
        cmd = [*python(), "-m", "megatron_gspo.cli", "train", "--config", str(config)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)
        assert done.returncode == 0, done.stderr[-4000:]
        versions = [httpx.get(f"{u}/get_model_info").json()["weight_version"] for u in (a.url, b.url)]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert versions == ["3", "3"]  # every worker at the final version
    assert rows[-1]["fleet/workers"] == 2 and rows[-1]["fleet/removed"] == 0


def test_a_port_taken_before_the_router_binds_it_is_chosen_again(monkeypatch):
    """A port found free can be taken before the router binds it (CI once lost a run to its
    Prometheus port so): the ports chosen by `launch_router` are chosen again, the caller's never."""
    from megatron_gspo.rollout import router_launch

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        real = router_launch._free_port
        chosen = iter([real(), taken])  # the router's port, then its Prometheus port: taken
        monkeypatch.setattr(router_launch, "_free_port", lambda: next(chosen, None) or real())
        with launch_router([]) as router:
            assert httpx.get(f"{router.url}/workers", timeout=10).status_code == 200
        with pytest.raises(RuntimeError, match="Address already in use"), launch_router([], port=taken):
            pass
