"""`weight_sync.method: tensor`: SGLang's tensor handles move no weight bytes over HTTP.

An embedded server in this process (its aiohttp app on a thread), so that its model's parameters
can be compared with the trainer's bit for bit after each sync; the handles are opened through the
server's own unpickler from the request bodies. (A server in another process opening them by name:
`test_weight_sync.py::test_tensor_and_disk_methods_serve_the_trainer_weights`; SGLang's own
deserializer: `test_weight_sync_sglang.py`.)
"""

import asyncio
import gc
import os
import threading
from pathlib import Path

import httpx
import pytest
import torch
from aiohttp import web
from world_one import world_one_policy

from megatron_gspo.config import WeightSyncConfig
from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import hf_to_module_state
from megatron_gspo.model.hf.stream import run_on_hf_stream
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.server import http_app
from megatron_gspo.rollout.server.engine import GenerationEngine
from megatron_gspo.rollout.server.main import build_app
from megatron_gspo.rollout.server.scheduler import BatchScheduler
from megatron_gspo.rollout.server.service import RolloutService
from megatron_gspo.weight_sync.sync import WeightSync

CFG = tiny(vocab_size=80, init_std=0.2)
BUCKET_MB = 0.01  # ~10 KiB: several buckets, the embedding (80 x 64 fp32 = 20 KiB) alone in one


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with world_one_policy(tmp_path_factory.mktemp("hf"), CFG, seed=3) as (model, checkpoint):
        engine = GenerationEngine(checkpoint)
        service = RolloutService(engine, BatchScheduler(engine, batch_window_s=0.0, max_batch_size=4))
        app, pools = build_app(service, 4, 2**30)
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        sock = http_app.bind("127.0.0.1", 0)
        loop.run_until_complete(web.SockSite(runner, sock).start())
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        bodies: list[int] = []

        def record(request: httpx.Request) -> None:
            if request.url.path == "/update_weights_from_tensor":
                bodies.append(len(request.content))

        client = SGLangClient([f"http://127.0.0.1:{sock.getsockname()[1]}"], max_retries=0)
        client._http.event_hooks["request"].append(record)
        try:
            yield model, engine, client, bodies, tmp_path_factory.mktemp("export")
        finally:
            client.close()
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)
            service.scheduler.close()
            for pool in pools:
                pool.shutdown(wait=False)


def test_handles_carry_no_weight_bytes_and_the_server_gets_the_weights_bit_for_bit(setup):
    model, engine, client, bodies, export_dir = setup
    sync = WeightSync(
        WeightSyncConfig(method="tensor", bucket_mb=BUCKET_MB, retries=0), model, CFG, export_dir
    )
    for version, scale in ((1, 0.9), (2, 1.1)):
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(scale)
        bodies.clear()
        segments = set(Path("/dev/shm").glob(f"torch_{os.getpid()}_*"))
        stats = sync.sync(client, version)
        expected = run_on_hf_stream(model, CFG, lambda stream: {n: t.clone() for n, t in stream})
        served = engine.model.state_dict()
        for name, want in hf_to_module_state(expected, CFG.num_experts).items():
            assert torch.equal(served[name], want), f"{name} differs after sync {version}"
        assert client.model_info()[0]["weight_version"] == str(version)
        # One request per bucket; each a pickle of handles and metadata: ~1 KiB, whatever the bytes.
        assert len(bodies) == stats.buckets > 3
        largest, total = max(bodies), sum(bodies)
        print(
            f"sync {version}: {stats.buckets} buckets, {stats.bytes} tensor bytes "
            f"(largest bucket {stats.largest_bucket_bytes}); request bodies {total} bytes (largest {largest})"
        )
        assert largest < 4096 < stats.largest_bucket_bytes
        assert total < stats.bytes / 10
        gc.collect()  # the shared-memory segments of the buckets are gone once both sides dropped them
        assert set(Path("/dev/shm").glob(f"torch_{os.getpid()}_*")) <= segments
