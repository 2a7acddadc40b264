"""The client end to end against the embedded SGLang-protocol server (a real tiny Qwen3-MoE)."""

from __future__ import annotations

import httpx
import pytest

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.rollout import (
    RolloutBatch,
    RolloutRequestError,
    SGLangClient,
    StaleRolloutError,
    WeightUpdateError,
    build_generate_request,
    parse_generate_response,
)
from megatron_gspo.rollout.errors import GenerationCancelledError
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
CFG = tiny(vocab_size=len(TOKENIZER))
GROUP = 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return make_tiny_hf_checkpoint(root / "a", CFG, seed=0), make_tiny_hf_checkpoint(root / "b", CFG, seed=1)


@pytest.fixture(scope="module")
def client(checkpoints):
    with launch_embedded_server(checkpoints[0]) as server:
        with SGLangClient(
            [server.url], max_concurrency=4, timeout_s=60.0, max_retries=1, backoff_s=0.05
        ) as c:
            c.wait_until_healthy(timeout_s=30.0)
            yield c


def rollout(client, prompts, expected_version):
    requests = [
        build_generate_request(
            p,
            {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": j, "ignore_eos": True},
            return_routed_experts=True,
            rid=f"{g}-{j}",
        )
        for g, p in enumerate(prompts)
        for j in range(GROUP)
    ]
    samples = []
    for i, (request, response) in enumerate(zip(requests, client.generate(requests))):
        sample = parse_generate_response(
            request["input_ids"],
            response,
            vocab_size=len(TOKENIZER),
            num_layers=CFG.num_layers,
            topk=CFG.moe_topk,
            num_experts=CFG.num_experts,
            expect_routed_experts=True,
            rid=request["rid"],
        )
        sample.group_index = i // GROUP
        samples.append(sample)
    return samples, RolloutBatch.from_samples(samples, GROUP, expected_weight_version=expected_version)


def test_rollout_weight_sync_and_staleness_end_to_end(client, checkpoints):
    prompts = [TOKENIZER.encode("12+34="), TOKENIZER.encode("5+6=")]
    version = client.generate([build_generate_request(prompts[0], {"max_new_tokens": 1})])[0]["meta_info"][
        "weight_version"
    ]
    old_samples, batch = rollout(client, prompts, version)
    assert batch.num_groups == 2 and batch.tokens.shape == (6, len(prompts[0]) + 5)
    assert batch.response_mask.sum().item() == 6 * 5
    assert batch.routed_experts[0].shape == (len(prompts[0]) + 5 - 1, CFG.num_layers, CFG.moe_topk)
    assert (batch.rollout_logprobs <= 0).all() and (batch.rollout_logprobs * batch.response_mask < 0).any()

    answers = client.update_weights_from_disk(str(checkpoints[1]), weight_version=7)
    assert answers[0]["success"] is True
    with pytest.raises(StaleRolloutError, match="expects '7'"):
        RolloutBatch.from_samples(old_samples, GROUP, expected_weight_version=7)
    _, fresh = rollout(client, prompts, 7)
    assert fresh.weight_versions == ["7"] * 6


def test_server_errors_surface_through_the_client(client):
    with pytest.raises(WeightUpdateError, match="nonexistent"):
        client.update_weights_from_disk("/nonexistent/checkpoint", weight_version=99)
    with pytest.raises(RolloutRequestError, match="unknown field `temprature`"):
        client.generate([{"input_ids": [1, 2], "sampling_params": {"temprature": 1.0}}])
    assert client.pause_generation() and client.flush_cache() and client.continue_generation()


def test_generate_batched_equals_single_requests_and_keeps_order(client):
    prompts = [TOKENIZER.encode(p) for p in ("1+2=", "33+4=", "9+9=", "50+50=")]
    requests = [
        build_generate_request(
            p, {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 10 + i}, rid=f"r{i}"
        )
        for i, p in enumerate(prompts)
    ]
    batched = client.generate_batched(requests)
    single = client.generate(requests)
    assert [r["meta_info"]["id"] for r in batched] == ["r0", "r1", "r2", "r3"]
    for request, a, b in zip(requests, batched, single):
        assert a["output_ids"] == b["output_ids"]  # same seeds: same samples, batched or not
        sample = parse_generate_response(
            request["input_ids"], a, vocab_size=len(TOKENIZER), rid=request["rid"]
        )
        assert sample.response_length == len(a["output_ids"]) >= 1
    assert client.generate_batched([]) == []


def test_cancel_generation_ends_a_batch_under_way(client):
    """A stopping run (its producer closed) ends the batch it generates instead of waiting for it."""
    url, long = client.urls[0], 400

    def generated() -> int:
        return int(httpx.get(f"{url}/get_server_info", timeout=30).json()["num_generated_tokens"])

    before = generated()
    params = {"max_new_tokens": long, "temperature": 1.0, "ignore_eos": True}
    bodies = [
        build_generate_request([1, 2, 3], {**params, "sampling_seed": j}, rid=f"c{j}") for j in range(4)
    ]
    call = client._background.submit(client.generate_batched, bodies)
    while generated() < before + 8:  # the batch is generating (hang guard: the call's own)
        assert not call.done(), call.exception()
    client.cancel_generation()
    with pytest.raises(GenerationCancelledError):
        call.result(timeout=60)
    assert generated() < before + 4 * long  # aborted on the server, not generated to the end
