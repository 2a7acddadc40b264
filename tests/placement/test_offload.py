"""The trainer's state parked in host memory and brought back, on a real tiny Megatron MoE.

The storage path (copy to host, shrink the device storage to zero bytes, grow it back, copy in)
runs on the CPU here with `include_host`: afterwards parameters, DDP gradient buffers and Adam
state equal the originals bit for bit, and every view still aliases its buffer. On a CPU-only
run `TrainerOffload` moves nothing (the compute device is the host). A colocated checkpoint's
hand-over frees an embedded server's KV cache for the save's duration.
"""

import logging

import httpx
import pytest
import torch

from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.model.optim import OptimConfig, build_optimizer, optimizer_step, wrap_ddp, zero_grads
from megatron_gspo.placement.colocation import Colocated
from megatron_gspo.placement.offload import (
    ParkedStorages,
    TrainerOffload,
    pinned_host_bytes,
    trainer_state_tensors,
)
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.tasks.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def trained():
    init_distributed(ParallelConfig(), seed=3)
    model = wrap_ddp(build_model(tiny(vocab_size=32), ParallelConfig()))
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=1e-2))
    zero_grads(model, optimizer)
    ids = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(0))
    model(ids, torch.arange(8)[None], None).float().pow(2).mean().backward()
    assert optimizer_step(model, optimizer, scheduler)[0]  # Adam's moments exist, grads are non-zero
    yield model, optimizer
    destroy_distributed()


def test_offload_then_onload_restores_every_byte_and_keeps_views(trained):
    model, optimizer = trained
    tensors = trainer_state_tensors(model, optimizer)
    before = [t.detach().clone() for t in tensors]
    grad_buffer = model.buffers[0].grad_data
    params = list(model.module.parameters())
    before_main_grads = [p.main_grad.clone() for p in params]
    parked = ParkedStorages(tensors, include_host=True)
    assert parked.nbytes > 0
    parked.offload()
    assert parked.offloaded and grad_buffer.untyped_storage().nbytes() == 0  # really given back
    parked.onload()
    assert not parked.offloaded
    assert all(torch.equal(a, b) for a, b in zip(before, tensors))
    # The storage was reallocated in place: every main_grad still views the (regrown) buffer.
    lo, hi = grad_buffer.data_ptr(), grad_buffer.data_ptr() + grad_buffer.untyped_storage().nbytes()
    assert all(lo <= p.main_grad.data_ptr() < hi for p in params)
    grad_buffer.add_(1.0)  # one memory: a write through the buffer is seen through the views
    assert all(torch.equal(p.main_grad, b + 1.0) for p, b in zip(params, before_main_grads))
    grad_buffer.sub_(1.0)
    state = [v for s in optimizer.chained_optimizers[0].optimizer.state.values() for v in s.values()]
    assert any(isinstance(v, torch.Tensor) and v.abs().sum() > 0 for v in state)


def test_the_trainer_offload_copies_weights_and_optimizer_state_and_drops_the_gradients(trained):
    """The GPU's path on the CPU (`include_host`): parameters and Adam state come back bit for bit;
    the gradients are not copied to the host but given back and brought back zeroed (every
    mini-batch zeroes them before its backward), and `main_grad` still views DDP's buffer."""
    model, optimizer = trained
    ids = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(1))
    model(ids, torch.arange(8)[None], None).float().pow(2).mean().backward()
    grad_buffer = model.buffers[0].grad_data
    assert grad_buffer.abs().sum() > 0  # something for the offload to drop
    params = list(model.module.parameters())
    inner = optimizer.chained_optimizers[0].optimizer
    state = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    kept = params + state
    before = [t.detach().clone() for t in kept]
    copied = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}.values())
    offload = TrainerOffload(model, optimizer, include_host=True)
    assert offload.offload() == copied  # weights and optimizer state; no gradient byte
    assert offload.host_nbytes == copied  # not pinned on a CPU-only host: no rounding
    assert grad_buffer.untyped_storage().nbytes() == 0 and params[0].untyped_storage().nbytes() == 0
    offload.onload()
    assert all(torch.equal(a, b) for a, b in zip(before, kept))
    assert grad_buffer.untyped_storage().nbytes() > 0 and not grad_buffer.any()  # back, zeroed
    lo, hi = grad_buffer.data_ptr(), grad_buffer.data_ptr() + grad_buffer.untyped_storage().nbytes()
    assert all(lo <= p.main_grad.data_ptr() < hi for p in params)


@pytest.mark.parametrize(
    ("nbytes", "host"),
    [
        (0, 0),
        (1, 1),
        (2, 2),
        (3, 4),
        (1000, 1024),
        (2**30, 2**30),
        (2**30 + 1, 2**31),
        (9_600 * 2**20, 2**34),
    ],
)
def test_pinned_host_copies_are_counted_as_the_pinned_allocator_rounds_them(nbytes, host):
    # torch's CachingHostAllocator allocates c10::llvm::PowerOf2Ceil(size): a 9.6 GiB buffer takes 16 GiB
    assert pinned_host_bytes(nbytes) == host


def test_trainer_offload_on_cpu_moves_nothing(trained):
    model, optimizer = trained
    tensors = trainer_state_tensors(model, optimizer)
    ptrs = [t.data_ptr() for t in tensors]
    offload = TrainerOffload(model, optimizer)
    assert offload.offload() == 0
    offload.onload()
    assert [t.data_ptr() for t in tensors] == ptrs


@pytest.mark.slow  # one embedded server
def test_a_colocated_checkpoint_frees_the_servers_kv_cache_for_its_duration(trained, tmp_path, caplog):
    """Colocated.state_on_device (the save's): the idle servers free their KV cache while the
    trainer's state is on the device, and take it back after; a server that cannot free it is
    logged and the save goes on (the cache left as it was). Before the servers are up, nothing is asked."""
    model, optimizer = trained
    tokenizer = build_char_tokenizer()
    hf = make_tiny_hf_checkpoint(tmp_path / "hf", tiny(vocab_size=len(tokenizer)), seed=0)
    body = {"input_ids": tokenizer.encode("1+2="), "sampling_params": {"max_new_tokens": 2}}
    with (
        launch_embedded_server(hf, enable_memory_saver=True, kv_pool_mb=1) as server,
        SGLangClient([server.url]) as client,
    ):

        def generate():
            return httpx.post(f"{server.url}/generate", json=body, timeout=60)

        placement = Colocated(TrainerOffload(model, optimizer))
        with placement.state_on_device():  # the cold start's save: no server asked
            assert generate().status_code == 200
        placement.start(client)
        with placement.state_on_device():
            refused = generate()
            assert refused.status_code == 400 and "MemoryReleased" in refused.text
        assert generate().status_code == 200
        client.release_memory_occupation(["kv_cache"])  # freed already: the save's own release fails
        with caplog.at_level(logging.WARNING), placement.state_on_device():
            pass
        assert "the servers keep their KV cache" in caplog.text
        assert "MemoryReleased" in generate().text  # not resumed by the save: left as it was


@pytest.mark.slow  # one embedded server
def test_a_tag_left_released_by_a_failed_sync_is_not_released_again(trained, tmp_path, caplog):
    """SGLang's memory saver ends the scheduler on a second release of a tag ("Cannot pause
    allocation that is not active."); the embedded server refuses one (MemoryReleased), so a second
    attempt is seen here. A sync that raised after the weights were resumed leaves the KV cache
    released: the next hand-over releases the weights only, and the next sync resumes both."""
    model, optimizer = trained
    hf = make_tiny_hf_checkpoint(tmp_path / "hf", tiny(vocab_size=len(build_char_tokenizer())), seed=0)

    def failing_sync():
        raise RuntimeError("the sync failed")

    with (
        launch_embedded_server(hf, enable_memory_saver=True, kv_pool_mb=1) as server,
        SGLangClient([server.url]) as client,
    ):
        placement = Colocated(TrainerOffload(model, optimizer))
        placement.start(client)
        placement.to_training(client)
        with pytest.raises(RuntimeError, match="the sync failed"):
            placement.sync(client, failing_sync)  # weights resumed, the KV cache still released
        with caplog.at_level(logging.WARNING):
            placement.to_training(client)  # a second kv_cache release would be refused here
        assert "kv_cache is released already" in caplog.text
        placement.sync(client, lambda: None)
        assert placement.memory.released == set()
        client.release_memory_occupation(["kv_cache", "weights"])  # both held again: accepted
        client.resume_memory_occupation(["kv_cache", "weights"])


@pytest.mark.slow  # one embedded server
def test_a_colocated_sync_reads_the_weights_on_the_device_then_parks_them(trained, tmp_path):
    """The GPU's order on the CPU (`include_host` parks host storages too): after training the
    gradients and optimizer state are parked, the servers resume, the sync reads the parameters
    where they are, and only then are the parameters parked; the server serves the trainer's
    weights. (Parking the parameters before the sync leaves it zero-byte storages to read.)
    `trained` sets up the world of one."""
    from served import served_logprobs

    from megatron_gspo.config import WeightSyncConfig
    from megatron_gspo.model.logprobs import sequence_logprobs
    from megatron_gspo.weight_sync.sync import WeightSync

    cfg = tiny(vocab_size=len(build_char_tokenizer()))
    hf = make_tiny_hf_checkpoint(tmp_path / "hf", cfg, seed=0)
    model = wrap_ddp(build_model(cfg, ParallelConfig()))  # megatron's own init: not the server's weights
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=1e-2))
    zero_grads(model, optimizer)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    model(tokens[:1], torch.arange(12)[None], None).float().pow(2).mean().backward()
    assert optimizer_step(model, optimizer, scheduler)[0]
    offload = TrainerOffload(model, optimizer, include_host=True)
    placement = Colocated(offload)
    sync = WeightSync(
        WeightSyncConfig(method="tensor", bucket_mb=0.01, retries=0),
        model,
        cfg,
        tmp_path / "x",
        colocated=True,
    )
    param, grads = next(model.module.parameters()), model.buffers[0].grad_data
    with (
        launch_embedded_server(hf, enable_memory_saver=True, kv_pool_mb=1) as server,
        SGLangClient([server.url]) as client,
    ):
        ours = sequence_logprobs(model, list(tokens))[0][:, 1:].double()
        assert (served_logprobs(client, tokens) - ours).abs().max() > 1e-2  # the check below can fail
        placement.start(client)
        placement.to_training(client)
        seen = {}

        def send():
            seen["bytes"] = param.untyped_storage().nbytes(), grads.untyped_storage().nbytes()
            return sync.sync(client, 1)

        _, timings = placement.sync(client, send)
        assert seen["bytes"][0] > 0 and seen["bytes"][1] == 0  # read on the device; the rest parked
        assert param.untyped_storage().nbytes() == 0  # parked once sent
        parked = sum(
            s.nbytes() for s in {t.untyped_storage() for t in trainer_state_tensors(model, optimizer)}
        )
        assert parked == 0 and timings["colocate/offload_bytes"] > 0
        served = served_logprobs(client, tokens)  # the servers resumed their KV cache: generating
        offload.onload()
        assert (served - ours).abs().max() < 1e-5
