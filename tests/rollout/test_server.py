"""The embedded rollout server over HTTP, checked against an independent teacher-forced HF forward."""

import base64
import re
import threading

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import load_hf_state_dict, make_tiny_hf_checkpoint, save_hf_state_dict
from megatron_gspo.rollout import contract
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.tasks.tokenizer import build_char_tokenizer
from megatron_gspo.weight_sync import tensor_handles

TOKENIZER = build_char_tokenizer()
# init std 0.2: sharp logits and routing, so a wrong definition shows up far above float noise.
CFG = tiny(vocab_size=len(TOKENIZER), init_std=0.2)
PROMPT = TOKENIZER.encode("12+34=")
TOPK = CFG.moe_topk


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return make_tiny_hf_checkpoint(root / "a", CFG, seed=0), make_tiny_hf_checkpoint(root / "b", CFG, seed=1)


@pytest.fixture(scope="module")
def server(checkpoints):
    with launch_embedded_server(checkpoints[0], extra_args=["--check-responses"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=120) as c:
        yield c


def _tensor_update(client, server, named, **fields):
    """/update_weights_from_tensor inside a session, as SGLang requires: (its answer, the end's answer)."""
    assert client.post(f"{server.url}/begin_weight_update", json={}).json()["success"]
    entry = tensor_handles.serialize(
        [
            (n, tensor_handles.shareable(t.reshape(-1).view(torch.uint8)).view(t.dtype).reshape(t.shape))
            for n, t in named.items()
        ]
    )
    r = client.post(
        f"{server.url}/update_weights_from_tensor", json={"serialized_named_tensors": [entry], **fields}
    )
    return r, client.post(f"{server.url}/end_weight_update", json={})


def _reference(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def teacher_forced(model, seq):
    """Logits [T, V] and router logits [T, L, E] of one teacher-forced forward."""
    out = model(torch.tensor([seq]), output_router_logits=True)
    return out.logits[0].float(), torch.stack([r.float() for r in out.router_logits], dim=1)


def _generate(client, server, **body):
    r = client.post(f"{server.url}/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _decode_routing(b64, rows):
    arr = np.frombuffer(base64.b64decode(b64), dtype="<i4")
    return arr.reshape(rows, CFG.num_layers, TOPK)


def test_generate_matches_teacher_forced_logprobs_and_routing(server, client, checkpoints):
    temp = 0.7
    resp = _generate(
        client,
        server,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 12, "temperature": temp, "sampling_seed": 5, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
        return_routed_experts=True,
    )
    contract.require().GenerateResponse.from_json_value(resp)
    meta, out = resp["meta_info"], resp["output_ids"]
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == len(out) == 12
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["weight_version"] == "default"
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out
    seq = PROMPT + out
    logits, router = teacher_forced(_reference(checkpoints[0]), seq)
    p = len(PROMPT)
    ref_out = torch.log_softmax(logits / temp, -1)[p - 1 : -1].gather(1, torch.tensor(out)[:, None])[:, 0]
    got_out = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    assert (got_out - ref_out).abs().max() < 1e-5
    # Input log-probs are raw (SGLang never temperature-scales prefill); the first entry is null.
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == PROMPT and inp[0][0] is None
    ref_in = torch.log_softmax(logits, -1)[: p - 1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    assert (torch.tensor([lp for lp, _, _ in inp[1:]]) - ref_in).abs().max() < 1e-5
    # Routed experts: rows for positions [0, seqlen-1), the model's top-k of softmax(router logits).
    routed = _decode_routing(meta["routed_experts"], len(seq) - 1)
    probs = torch.softmax(router[:-1], dim=-1)
    ref_sets = probs.topk(TOPK, dim=-1).indices.sort(-1).values.numpy()
    sorted_probs = probs.sort(-1, descending=True).values
    near_tie = (sorted_probs[..., TOPK - 1] - sorted_probs[..., TOPK]).numpy() < 1e-5
    same = (np.sort(routed, -1) == ref_sets).all(-1)
    assert (same | near_tie).all() and same.mean() > 0.99
    assert set(np.unique(routed)) <= set(range(CFG.num_experts))


def test_routed_experts_start_len_and_greedy_raw_logprobs(server, client, checkpoints):
    full = _generate(
        client,
        server,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
        return_logprob=True,
        return_routed_experts=True,
    )
    part = _generate(
        client,
        server,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
        return_routed_experts=True,
        routed_experts_start_len=4,
    )
    assert full["output_ids"] == part["output_ids"]
    seq = PROMPT + full["output_ids"]
    rows = len(seq) - 1
    assert np.array_equal(
        _decode_routing(part["meta_info"]["routed_experts"], rows - 4),
        _decode_routing(full["meta_info"]["routed_experts"], rows)[4:],
    )
    assert (
        "output_token_logprobs" not in part["meta_info"] and "input_token_logprobs" not in full["meta_info"]
    )
    logits, _ = teacher_forced(_reference(checkpoints[0]), seq)
    p = len(PROMPT)
    assert full["output_ids"] == logits[p - 1 : -1].argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)[p - 1 : -1].gather(1, torch.tensor(full["output_ids"])[:, None])[:, 0]
    got = torch.tensor([lp for lp, _, _ in full["meta_info"]["output_token_logprobs"]])
    assert (got - ref).abs().max() < 1e-5


def test_stop_token_ends_generation_and_is_reported(server, client):
    greedy = _generate(
        client,
        server,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    )
    stop = greedy["output_ids"][2]
    first = greedy["output_ids"].index(stop)
    resp = _generate(
        client,
        server,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop]},
    )
    assert resp["output_ids"] == greedy["output_ids"][: first + 1]
    assert resp["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert resp["text"] == TOKENIZER.decode(resp["output_ids"][:-1])  # the matched token is trimmed from text


def test_bad_requests_get_400_naming_the_problem(server, client):
    url = f"{server.url}/generate"
    r = client.post(url, json={"input_ids": PROMPT, "sampling_params": {"max_new_tokns": 3}})
    assert r.status_code == 400 and "unknown field `max_new_tokns`" in r.json()["error"]["message"]
    r = client.post(url, json={"input_ids": "12", "sampling_params": {}})
    assert r.status_code == 400 and "input_ids must be a non-empty list" in r.json()["error"]["message"]
    r = client.post(url, json={"input_ids": PROMPT, "sampling_params": {"stop": ["\n"]}})
    assert r.status_code == 400 and "sampling_params.stop" in r.json()["error"]["message"]
    r = client.post(url, json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 600}})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    r = client.post(url, json={"input_ids": [1, 500]})
    assert r.status_code == 400 and "outside [0, 79)" in r.json()["error"]["message"]
    r = client.post(url, json={"input_ids": PROMPT, "stream": True})
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]


def test_seeded_sampling_is_independent_of_batch_company(server, client):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 10, "sampling_seed": 42, "ignore_eos": True},
    }
    alone = _generate(client, server, **body, return_logprob=True)
    # Same request inside a batch request with other prompts and seeds.
    batch = _generate(
        client,
        server,
        input_ids=[TOKENIZER.encode("9*9="), PROMPT, TOKENIZER.encode("1")],
        sampling_params=[
            {"max_new_tokens": 4, "sampling_seed": 1},
            body["sampling_params"],
            {"max_new_tokens": 15, "temperature": 0.5},
        ],
        return_logprob=True,
    )
    assert isinstance(batch, list) and len(batch) == 3
    assert batch[1]["output_ids"] == alone["output_ids"]
    # Same request sent concurrently with others (the server batches them together).
    results = {}

    def send(key, payload):
        with httpx.Client(timeout=120) as c:
            results[key] = c.post(f"{server.url}/generate", json=payload).json()

    threads = [threading.Thread(target=send, args=("seeded", body))] + [
        threading.Thread(
            target=send,
            args=(
                i,
                {"input_ids": TOKENIZER.encode("7" * (i + 1)), "sampling_params": {"max_new_tokens": 8}},
            ),
        )
        for i in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["seeded"]["output_ids"] == alone["output_ids"]
    lp_alone = [lp for lp, _, _ in alone["meta_info"]["output_token_logprobs"]]
    lp_batch = [lp for lp, _, _ in batch[1]["meta_info"]["output_token_logprobs"]]
    assert np.allclose(lp_alone, lp_batch, atol=1e-5)
    other_seed = _generate(
        client, server, **{**body, "sampling_params": {**body["sampling_params"], "sampling_seed": 7}}
    )
    assert other_seed["output_ids"] != alone["output_ids"]


def test_info_and_control_endpoints(server, client):
    assert client.get(f"{server.url}/health").status_code == 200
    assert client.get(f"{server.url}/health_generate").status_code == 200
    info = client.get(f"{server.url}/get_server_info").json()
    assert info["model_path"].endswith("a") and "weight_version" in info
    assert client.get(f"{server.url}/get_model_info").json()["model_type"] == "qwen3_moe"
    assert client.get(f"{server.url}/get_weight_version").status_code == 404  # not a 0.5.23 route
    assert client.post(f"{server.url}/flush_cache").status_code == 200
    assert client.post(f"{server.url}/pause_generation", json={"mode": "in_place"}).json()["status"] == "ok"
    holder = {}
    t = threading.Thread(
        target=lambda: holder.setdefault(
            "r",
            httpx.post(
                f"{server.url}/generate", json={"input_ids": PROMPT, "rid": "held"}, timeout=60
            ).json(),
        )
    )
    t.start()
    t.join(0.5)
    assert t.is_alive()  # held while paused
    assert client.post(f"{server.url}/abort_request", json={"rid": "held"}).status_code == 200
    t.join(30)
    assert holder["r"]["meta_info"]["finish_reason"]["type"] == "abort"
    client.post(f"{server.url}/continue_generation", json={})
    assert _generate(
        client, server, input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "ignore_eos": True}
    )


def _logprobs(client, server, seq_prompt, n=6):
    resp = _generate(
        client,
        server,
        input_ids=seq_prompt,
        sampling_params={"max_new_tokens": n, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True},
        return_logprob=True,
    )
    return resp, torch.tensor([lp for lp, _, _ in resp["meta_info"]["output_token_logprobs"]])


def _ref_logprobs(model, resp):
    seq = PROMPT + resp["output_ids"]
    logits, _ = teacher_forced(model, seq)
    p = len(PROMPT)
    return torch.log_softmax(logits, -1)[p - 1 : -1].gather(1, torch.tensor(resp["output_ids"])[:, None])[
        :, 0
    ]


def test_update_weights_from_disk_serves_new_model_and_rejects_bad_paths(server, client, checkpoints):
    a, b = checkpoints
    url = f"{server.url}/update_weights_from_disk"
    r = client.post(url, json={"model_path": str(b), "weight_version": "1", "flush_cache": True})
    assert r.status_code == 200 and r.json()["success"] is True
    resp, got = _logprobs(client, server, PROMPT)
    assert resp["meta_info"]["weight_version"] == "1"
    assert (got - _ref_logprobs(_reference(b), resp)).abs().max() < 1e-5
    assert (got - _ref_logprobs(_reference(a), resp)).abs().max() > 1e-2  # really a different model
    bad = client.post(url, json={"model_path": str(b.parent / "missing")})
    assert bad.status_code == 400 and bad.json()["success"] is False and "missing" in bad.json()["message"]
    other = tiny(vocab_size=len(TOKENIZER), num_experts=4)
    wrong = make_tiny_hf_checkpoint(b.parent / "wrong", other, seed=0)
    bad = client.post(url, json={"model_path": str(wrong)})
    assert bad.json()["success"] is False and "num_experts" in bad.json()["message"]
    resp, got = _logprobs(client, server, PROMPT)  # still model b, version 1
    assert resp["meta_info"]["weight_version"] == "1"
    assert (got - _ref_logprobs(_reference(b), resp)).abs().max() < 1e-5
    r = client.post(url, json={"model_path": str(a), "weight_version": "2"})
    assert r.json()["success"] and client.get(f"{server.url}/model_info").json()["weight_version"] == "2"


def test_update_weights_from_tensor_loads_the_tensors(server, client, checkpoints):
    a, b = checkpoints
    state_b = load_hf_state_dict(b)
    # Layer 1's experts and router from b, everything else from a: a genuinely new model.
    partial = {k: v for k, v in state_b.items() if k.startswith("model.layers.1.mlp.")}
    outside = client.post(
        f"{server.url}/update_weights_from_tensor",
        json={"serialized_named_tensors": [tensor_handles.serialize(list(partial.items()))]},
    )
    assert (
        outside.status_code == 400 and "between begin_weight_update() and end_weight_update()" in outside.text
    )
    r, end = _tensor_update(client, server, partial, weight_version="3")
    assert r.status_code == 200 and r.json()["success"] and end.json()["success"], r.text
    ref_mixed_dir = save_hf_state_dict(
        b.parent / "mixed", {**load_hf_state_dict(a), **partial}, CFG, TOKENIZER
    )
    mixed = _reference(ref_mixed_dir)
    resp, got = _logprobs(client, server, PROMPT)
    assert resp["meta_info"]["weight_version"] == "3"
    assert (got - _ref_logprobs(mixed, resp)).abs().max() < 1e-5
    r, end = _tensor_update(client, server, partial)  # no weight_version: SGLang keeps the label
    assert r.json()["success"] and end.json()["success"], r.text
    assert client.get(f"{server.url}/model_info").json()["weight_version"] == "3"
    bad, end = _tensor_update(client, server, {"model.nope.weight": torch.ones(2)})
    assert bad.status_code == 400 and "model.nope.weight" in bad.json()["message"]
    assert end.json()["success"]  # SGLang's end closes the session whatever its buckets did
    resp, got = _logprobs(client, server, PROMPT)  # the refused bucket loaded nothing: the mixed model
    assert (got - _ref_logprobs(mixed, resp)).abs().max() < 1e-5


def test_unknown_sampling_key_refused_with_and_without_the_wheel(monkeypatch):
    """SGLang's contract refuses an unknown sampling_params key; without the wheel the server must too."""
    from megatron_gspo.rollout import contract
    from megatron_gspo.rollout.server import protocol as server_protocol

    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "bogus": 1}}
    api = contract.load()
    if api is not None:
        assert list(api.SamplingParams.__struct_fields__) == list(server_protocol.SGLANG_SAMPLING_KEYS)
        with pytest.raises(Exception, match="unknown field `bogus`"):
            server_protocol.parse_generate(body, None)
    monkeypatch.setattr(contract, "load", lambda: None)
    with pytest.raises(server_protocol.RequestError, match="unknown field `bogus`, expected one of `max_new"):
        server_protocol.parse_generate(body, None)
    ok = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": 0.5}}
    assert server_protocol.parse_generate(ok, None).rows[0].sampling.temperature == 0.5


def test_batch_rows_sharing_sampling_params_are_each_checked_with_their_own_seed():
    """Rows equal but for the seed share one check; one differing only in a value's type is checked alone."""
    from megatron_gspo.rollout.server import protocol as server_protocol

    params = [{"max_new_tokens": 3, "temperature": 1, "sampling_seed": seed} for seed in (7, None, 9)]
    body = {"input_ids": [[1, 2]] * 3, "sampling_params": params}
    rows = server_protocol.parse_generate(body, None).rows
    assert [row.sampling.sampling_seed for row in rows] == [7, None, 9]
    assert {(row.sampling.temperature, row.sampling.max_new_tokens) for row in rows} == {(1.0, 3)}
    for row, value, field in [
        (1, {"max_new_tokens": 3, "temperature": 1, "sampling_seed": -1}, "sampling_params[1].sampling_seed"),
        (2, {"max_new_tokens": 3, "temperature": True, "sampling_seed": 1}, "sampling_params[2].temperature"),
    ]:
        bad = [dict(params[0]), dict(params[0]), dict(params[0])]
        bad[row] = value
        with pytest.raises(server_protocol.RequestError, match=re.escape(field)):
            server_protocol.parse_generate({"input_ids": [[1, 2]] * 3, "sampling_params": bad}, None)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_updates_are_refused_and_old_weights_keep_serving(server, client, checkpoints, bad):
    a, _ = checkpoints
    version = client.get(f"{server.url}/model_info").json()["weight_version"]
    before, lp_before = _logprobs(client, server, PROMPT)
    state = load_hf_state_dict(a)
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    poisoned = {n: t.clone() for n, t in state.items()}
    poisoned[name][1, 1] = bad
    # Tensor update: a good tensor first, the poisoned one after it (nothing may be applied).
    partial = {"model.norm.weight": state["model.norm.weight"] * 2, name: poisoned[name]}
    r, _ = _tensor_update(client, server, partial, weight_version="bad")
    assert r.status_code == 400 and f"tensor {name} has 1 non-finite" in r.json()["message"], r.text
    # Disk update of a whole checkpoint with one poisoned tensor.
    bad_dir = save_hf_state_dict(a.parent / f"poisoned-{bad}", poisoned, CFG, TOKENIZER)
    r = client.post(
        f"{server.url}/update_weights_from_disk", json={"model_path": str(bad_dir), "weight_version": "bad"}
    )
    assert r.status_code == 400 and f"tensor {name} has 1 non-finite" in r.json()["message"], r.text
    after, lp_after = _logprobs(client, server, PROMPT)
    assert after["output_ids"] == before["output_ids"] and torch.equal(lp_after, lp_before)
    assert after["meta_info"]["weight_version"] == version
    assert client.get(f"{server.url}/model_info").json()["weight_version"] == version


def test_a_server_of_tp_size_2_opens_an_entry_per_rank_and_refuses_ranks_apart(client, checkpoints):
    """Each TP rank opens its own entry (SGLang's `deserialize_own_rank`): one entry leaves rank 1
    without one, ranks whose tensors differ would serve different weights; both are refused and the
    old weights keep serving. One process cannot join a weight-update group as two ranks."""
    a, b = checkpoints
    partial = {k: v for k, v in load_hf_state_dict(b).items() if k.startswith("model.layers.1.mlp.gate")}
    (name,) = partial
    other = {name: partial[name] + 1.0}

    def entry(named):  # each entry its own shared memory: a handle is opened once
        return tensor_handles.serialize(
            [(n, tensor_handles.shareable(t).reshape(t.shape)) for n, t in named.items()]
        )

    with launch_embedded_server(a, extra_args=["--tp-size", "2", "--base-gpu-id", "1"]) as srv:
        info = client.get(f"{srv.url}/server_info").json()
        assert (info["tp_size"], info["base_gpu_id"], info["gpu_id_step"]) == (2, 1, 1)

        def update(entries, version):
            assert client.post(f"{srv.url}/begin_weight_update", json={}).json()["success"]
            body = {"serialized_named_tensors": entries, "weight_version": version}
            answer = client.post(f"{srv.url}/update_weights_from_tensor", json=body)
            client.post(f"{srv.url}/end_weight_update", json={"abort": answer.status_code != 200})
            return answer

        short = update([entry(partial)], "1")
        assert (
            short.status_code == 400
            and "has 1 entries for a server of tp_size 2: TP rank 1 has none" in short.text
        )
        apart = update([entry(partial), entry(other)], "1")
        assert apart.status_code == 400 and f"TP rank 1's {name} differs from TP rank 0's" in apart.text
        assert client.get(f"{srv.url}/model_info").json()["weight_version"] == "default"
        ok = update([entry(partial), entry(partial)], "2")
        assert ok.status_code == 200, ok.text
        assert client.get(f"{srv.url}/model_info").json()["weight_version"] == "2"
        group = client.post(
            f"{srv.url}/init_weights_update_group",
            json={"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 3},
        )
        assert group.status_code == 400 and "as its tp_size=2 ranks" in group.text
