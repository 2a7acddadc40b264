"""RoutingReplay on megatron-core's RouterReplay: exact replay under perturbed routers, at world 1
and TP2 x EP2, with activation recompute, refusals, and megatron's class-level state."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from forked_torchrun import torchrun
from warm_python import python

from megatron_gspo.model import config as model_configs
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.logprobs import pack_sequences, packed_forward
from megatron_gspo.model.routing import RoutingCapture, RoutingError, RoutingLayerError, RoutingReplay

WORKER = Path(__file__).with_name("routing_replay_worker.py")


def run_worker(tmp_path, nproc=1, *args):
    out = tmp_path / "result"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = torchrun(nproc, WORKER) if nproc > 1 else [*python(), str(WORKER)]
    proc = subprocess.run(
        [*command, "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"result.rank{r}.json").read_text()) for r in range(nproc)]


def check_rank(result, local_tokens):
    assert result["layout_equal"] == result["layout_total"] > 0  # packed order == each sample alone
    assert result["local_tokens"] == local_tokens
    # Heavy perturbation: most real tokens change their top-k in >= 1 layer without replay...
    assert result["tokens_changed_without_replay"] >= 0.5 * result["tokens_valid"] > 0
    # ...and replay reproduces the recorded routing exactly, while the router still learns.
    assert result["replay_exact"]
    assert all(norm > 0 for norm in result["router_grad_norm"])
    assert result["dtype"] == "torch.uint8" and result["bytes_per_token"] == 2 * 2  # 2 layers x k=2 x 1 B
    assert result["instances_after_close"] == 0


def test_replay_world_1_with_and_without_activation_recompute(tmp_path):
    (plain,) = run_worker(tmp_path)
    check_rank(plain, local_tokens=plain["rows"] * 16)
    (recompute,) = run_worker(tmp_path, 1, "--recompute")
    check_rank(recompute, local_tokens=recompute["rows"] * 16)
    # The backward recompute replays the same experts: identical router gradients.
    assert recompute["router_grad_norm"] == pytest.approx(plain["router_grad_norm"], rel=1e-5)


@pytest.mark.multiprocess
def test_replay_tp2_ep2(tmp_path):
    results = run_worker(tmp_path, 4, "--tp", "2", "--ep", "2")
    for result in results:
        check_rank(result, local_tokens=result["rows"] * 16 // 2)  # SP: half the positions per TP rank


@pytest.fixture(scope="module")
def world1():
    init_distributed(ParallelConfig(), seed=3)
    yield model_configs.tiny(vocab_size=40)
    destroy_distributed()


def _forward(model, n=10):
    packed = pack_sequences([torch.arange(3, 3 + n)])
    with torch.no_grad():
        packed_forward(model, packed)


def test_refuses_model_without_replay(world1):
    model = build_model(world1, ParallelConfig(), routing_replay=False)
    with pytest.raises(RoutingError, match="built without routing replay"):
        RoutingReplay(model)


def test_refuses_fused_router(world1):
    model = build_model(world1, ParallelConfig(), routing_replay=True)
    model.config.moe_router_fusion = True  # what a user config could ask for
    with pytest.raises(RoutingError, match="moe_router_fusion=True .* silently bypasses"):
        RoutingReplay(model)


def test_class_level_state_cleared_between_models(world1):
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    first = build_model(world1, ParallelConfig(), routing_replay=True)
    with RoutingReplay(first) as replay:
        assert len(RouterReplay.global_router_replay_instances) == world1.num_layers
        with replay.recording() as rec:
            _forward(first)
        assert rec.routing.num_layers == world1.num_layers
        # Inside an open block the action is set; after it, nothing is left armed.
        assert all(i.router_replay_action is None and i.recorded_topk_idx is None for i in replay.instances)
    assert RouterReplay.global_router_replay_instances == []
    second = build_model(world1, ParallelConfig(), routing_replay=True)
    with RoutingReplay(second) as replay:
        assert replay.num_layers == world1.num_layers
        assert RouterReplay.global_router_replay_instances == replay.instances
        with replay.replaying(rec.routing):
            assert all(i.router_replay_action == RouterReplayAction.REPLAY_FORWARD for i in replay.instances)
    assert RouterReplay.global_router_replay_instances == []
    with pytest.raises(RoutingError, match="closed"):
        with replay.recording():
            pass


def test_replay_of_other_routing_is_what_the_model_uses(world1):
    model = build_model(world1, ParallelConfig(), routing_replay=True)
    target = [torch.tensor([[t % 8, (t + 3) % 8] for t in range(10)]) for _ in range(world1.num_layers)]
    with RoutingReplay(model) as replay, replay.replaying(target), RoutingCapture(model) as capture:
        _forward(model)
    got = capture.routing().stacked()
    assert torch.equal(got, torch.stack(target, 1).sort(-1).values)


def test_replay_input_errors(world1):
    model = build_model(world1, ParallelConfig(), routing_replay=True)
    with RoutingReplay(model) as replay:
        good = torch.zeros(10, 2, dtype=torch.long) + torch.tensor([0, 1])
        with pytest.raises(RoutingLayerError, match="routing has 1 layers, the model has 2"):
            with replay.replaying([good]):
                pass
        with pytest.raises(RoutingLayerError, match=r"expected \[tokens, 2\]"):
            with replay.replaying([good[:, :1], good[:, :1]]):
                pass
        with pytest.raises(RoutingError, match="outside"):
            with replay.replaying([good, good + 7]):
                pass
        with pytest.raises(RoutingError, match="same expert twice"):
            with replay.replaying([good, torch.zeros(10, 2, dtype=torch.long)]):
                pass
        with pytest.raises(RoutingError, match="no forward pass reached"):
            with replay.recording():
                pass
