"""SGLang's memory occupation API on the embedded server: tags, refusals, and the memory really freed.

The semantics run in process (a `RolloutService` without HTTP, milliseconds a call); one server
subprocess, launched with --enable-memory-saver and a KV pool, shows its RSS (psutil) drop on
release and come back on resume, through `SGLangClient`.
"""

import threading

import httpx
import psutil
import pytest
import torch

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import load_hf_state_dict, make_tiny_hf_checkpoint
from megatron_gspo.python_command import PYTHON_VAR
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.errors import RolloutRequestError, WeightUpdateError
from megatron_gspo.rollout.server.decode_aids import DecodeAids
from megatron_gspo.rollout.server.engine import GenerationEngine
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.rollout.server.scheduler import BatchScheduler
from megatron_gspo.rollout.server.service import RolloutService
from megatron_gspo.tasks.tokenizer import build_char_tokenizer
from megatron_gspo.weight_sync import tensor_handles

TOKENIZER = build_char_tokenizer()
CFG = tiny(vocab_size=len(TOKENIZER), init_std=0.2)
PROMPT = TOKENIZER.encode("12+34=")
GREEDY = {
    "input_ids": PROMPT,
    "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
}
MIB = 2**20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "a", CFG, seed=0)


def _service(path, **engine_args):
    engine = GenerationEngine(path, **engine_args)
    return RolloutService(engine, BatchScheduler(engine, batch_window_s=0.0, max_batch_size=8))


@pytest.fixture
def service(checkpoint):
    svc = _service(checkpoint, enable_memory_saver=True, kv_pool_bytes=MIB)
    yield svc
    svc.scheduler.close()


def _message(answer) -> str:
    return answer[1]["error"]["message"]


def test_refused_without_memory_saver(checkpoint):
    svc = _service(checkpoint)
    try:
        assert svc.server_info()[1]["enable_memory_saver"] is False
        for call in (svc.release_memory_occupation, svc.resume_memory_occupation):
            status, _ = answer = call({"tags": ["weights"]})
            assert status == 400 and _message(answer).startswith("MemorySaverDisabled: ")
            assert "--enable-memory-saver" in _message(answer)
        assert svc.generate(GREEDY)[0] == 200  # nothing was released
    finally:
        svc.scheduler.close()


def test_tags_release_and_resume_what_they_name(service, checkpoint):
    engine, memory = service.engine, service.engine.memory
    before = service.generate(GREEDY)[1]["output_ids"]
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}

    # kv_cache alone: the pool goes, the weights stay; generation is refused by name.
    assert service.release_memory_occupation({"tags": ["kv_cache"]}) == (200, None)
    assert memory.released == {"kv_cache"} and memory.kv_pool_allocated_bytes() == 0
    assert all(torch.equal(p, weights[n]) for n, p in engine.model.named_parameters())
    status, _ = refused = service.generate(GREEDY)
    assert status == 400 and _message(refused).startswith("MemoryReleased: ")
    assert _message(service.resume_memory_occupation({"tags": ["weights"]})).startswith("MemoryNotReleased: ")
    assert _message(service.release_memory_occupation({"tags": ["kv_cache"]})).startswith("MemoryReleased: ")
    assert service.resume_memory_occupation({"tags": ["kv_cache"]}) == (200, None)
    assert memory.released == set() and memory.kv_pool_allocated_bytes() == MIB
    assert service.generate(GREEDY)[1]["output_ids"] == before

    # No tags: all of SGLang's (kv_cache, weights, cuda_graph); the parameters lose their storage.
    assert service.release_memory_occupation({}) == (200, None)
    assert memory.released == {"kv_cache", "weights", "cuda_graph"}
    assert all(p.numel() == 0 for p in engine.model.parameters())
    update = service.update_weights_from_disk({"model_path": str(checkpoint)})
    assert update[0] == 400 and "MemoryReleased: cannot update weights" in update[1]["message"]
    assert service.resume_memory_occupation({"tags": []}) == (200, None)  # [] is all, as in SGLang
    assert memory.released == set()
    # Resumed weights hold no values (SGLang keeps none without a CPU backup): NaN here, refused.
    assert all(torch.isnan(p).all() for p in engine.model.parameters())
    assert _message(service.generate(GREEDY)).startswith("WeightsNotLoaded: ")
    on_disk = load_hf_state_dict(checkpoint)
    half = dict(list(on_disk.items())[: len(on_disk) // 2])
    assert engine.update_weights_from_tensors(half, None) == len(half)
    assert _message(service.generate(GREEDY)).startswith("WeightsNotLoaded: ")  # half are still NaN
    assert service.update_weights_from_disk({"model_path": str(checkpoint)})[0] == 200
    assert all(torch.equal(p, weights[n]) for n, p in engine.model.named_parameters())
    assert service.generate(GREEDY)[1]["output_ids"] == before


@pytest.mark.parametrize(
    "tags, wrong", [(["weights", "gpu"], "unknown memory tag(s) ['gpu']"), ("weights", "must be a list")]
)
def test_bad_tags_are_named(service, tags, wrong):
    for call in (service.release_memory_occupation, service.resume_memory_occupation):
        status, _ = answer = call({"tags": tags})
        assert status == 400 and wrong in _message(answer)
    assert service.engine.memory.released == set()


def test_release_refused_while_generating(checkpoint):
    svc = _service(checkpoint, enable_memory_saver=True, aids=DecodeAids(delay_s=0.01))
    try:
        long = {**GREEDY, "sampling_params": {**GREEDY["sampling_params"], "max_new_tokens": 200}}
        answers = []
        worker = threading.Thread(target=lambda: answers.append(svc.generate(long)))
        worker.start()
        while svc.engine.tokens_generated < 2:  # the batch runs (a hang guard is the test timeout)
            worker.join(0.005)
        status, _ = answer = svc.release_memory_occupation({})
        svc.abort_request({"abort_all": True})
        worker.join()
        assert status == 400 and _message(answer).startswith("ServerBusy: ")
        assert svc.engine.memory.released == set() and answers[0][0] == 200
    finally:
        svc.scheduler.close()


@pytest.mark.slow  # a server subprocess: ~8 s
def test_server_rss_drops_on_release_and_returns_on_resume(tmp_path, monkeypatch):
    """One subprocess server: weights of ~16 MiB (a 65,536-row vocabulary) and a 48 MiB KV pool."""
    monkeypatch.delenv(PYTHON_VAR, raising=False)  # its RSS is the launcher's child's
    big = tiny(vocab_size=65536, init_std=0.2)
    path = make_tiny_hf_checkpoint(tmp_path / "big", big, seed=0)
    weight_bytes = sum(t.numel() * t.element_size() for t in load_hf_state_dict(path).values())
    pool = 48 * MIB
    with (
        launch_embedded_server(path, enable_memory_saver=True, kv_pool_mb=pool / MIB) as server,
        SGLangClient([server.url], max_retries=0) as client,
    ):
        proc = psutil.Process(server.process.pid)
        before = client.generate([GREEDY])[0]["output_ids"]
        full = proc.memory_info().rss
        client.release_memory_occupation(["kv_cache"])
        no_kv = proc.memory_info().rss
        client.release_memory_occupation(["weights"])
        released = proc.memory_info().rss
        with pytest.raises(RolloutRequestError, match="MemoryReleased: cannot generate"):
            client.generate([GREEDY])
        with pytest.raises(WeightUpdateError, match="MemoryReleased:"):
            client.release_memory_occupation()  # kv_cache and weights are already released
        # A colocated step's order: weights back, the weights by tensor handles, then the KV cache.
        client.resume_memory_occupation(["weights"])
        with pytest.raises(
            RolloutRequestError, match="MemoryReleased: cannot generate while \\['kv_cache'\\]"
        ):
            client.generate([GREEDY])
        state = load_hf_state_dict(path)  # fp32 throughout: one bucket, every offset aligned
        flat = tensor_handles.shareable(torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()]))
        entry = tensor_handles.serialize_flattened_bucket(
            flat, list(state), ["float32"] * len(state), [list(t.shape) for t in state.values()]
        )
        client.begin_weight_update()
        client.update_weights_from_tensor([entry], load_format="flattened_bucket", flush_cache=False)
        client.end_weight_update()
        del flat, state
        client.resume_memory_occupation(["kv_cache"])
        resumed = proc.memory_info().rss
        after = client.generate([GREEDY])[0]["output_ids"]
        info = httpx.get(f"{server.url}/server_info").json()
    print(
        f"RSS MiB: with weights+KV {full / MIB:.1f}, KV released {no_kv / MIB:.1f}, both released "
        f"{released / MIB:.1f}, resumed {resumed / MIB:.1f} "
        f"(weights {weight_bytes / MIB:.1f}, pool {pool / MIB:.0f})"
    )
    assert info["enable_memory_saver"] is True
    assert full - no_kv > 0.9 * pool
    assert no_kv - released > 0.9 * weight_bytes
    assert resumed - released > 0.9 * (pool + weight_bytes)
    assert after == before
