"""Drift metrics and Routing Replay through `train_on_batch`, checked against answers known in advance.

A forward hook on every router, written here and independent of the code under test, records
what each router chose (forward calls and backward recomputes apart) and cuts it into samples by
the packing's segments. Against that record:
- old -> new drift: layer 1's router is perturbed between the pi_old pass and the updates (with
  a learning rate too small to move any weight), so the expected drift is 0 on layer 0 and the
  set difference of the two recorded routings on layer 1;
- inference -> training drift: the rollouts carry the model's own routing with chosen entries
  replaced (one expert of token 0, layer 0, in every other sample), so the expected drift is that
  count / k / routed tokens on layer 0 and 0 on layer 1;
- R3: the rollouts carry random routing, and every router call of the update (forward and
  recompute) must have used each sample's own rows;
- R2: every router call of the update after a heavy perturbation must have used what the routers
  chose in the pi_old pass.
"""

import pytest
import torch

from megatron_gspo.algorithms import compute_group_advantages
from megatron_gspo.config import AlgorithmConfig
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.optim import OptimConfig, build_optimizer, wrap_ddp
from megatron_gspo.model.pipeline import run_micro_batches
from megatron_gspo.model.routing import moe_routers
from megatron_gspo.rollout import RolloutBatch, RolloutSample
from megatron_gspo.training.step.routing import StepRouting
from megatron_gspo.training.step.update import (
    DataLayout,
    plan_mini_batches,
    recompute_old_logprobs,
    train_on_batch,
)

VOCAB, GROUPS, G, T, MINI = 32, 4, 2, 1.0, 2


@pytest.fixture
def model():
    init_distributed(ParallelConfig(), seed=5)
    ddp = wrap_ddp(build_model(tiny(vocab_size=VOCAB), ParallelConfig(), routing_replay=True))
    yield ddp
    destroy_distributed()


class RouterLog:
    """Every router call: (layer, in a backward recompute?, [tokens, k] chosen expert ids, sorted)."""

    def __init__(self, model):
        self.calls = []
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(moe_routers(model))]

    def _hook(self, layer):
        def hook(module, inputs, output):
            routing_map = output[1]  # [tokens, experts] bool, k True per token
            ids = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1)
            self.calls.append((layer, torch._C._current_graph_task_id() != -1, ids.cpu()))

        return hook

    def close(self):
        for h in self.handles:
            h.remove()

    def per_sample(self, micro_batches, *, recompute=False):
        """{sample: [n - 1, layers, k]} of the routed tokens, from the calls in micro-batch order."""
        layers = len(self.handles)
        calls = [ids for _, rec, ids in self.calls if rec == recompute]
        assert len(calls) == layers * len(micro_batches)
        out = {}
        for m, micro in enumerate(micro_batches):
            rows, length = micro.packed.tokens.shape
            per_layer = [calls[m * layers + j].view(length, rows, -1) for j in range(layers)]
            for b, (row, start, n) in zip(micro.indices, micro.packed.segments):
                out[b] = torch.stack([p[start : start + n - 1, row] for p in per_layer], dim=1)
        return out


def make_batch(routes=None):
    gen = torch.Generator().manual_seed(3)
    samples = []
    for g in range(GROUPS):
        prompt = torch.randint(3, VOCAB, (3 + g,), generator=gen)
        for i in range(G):
            response = torch.randint(
                3, VOCAB, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen
            )
            rows = len(prompt) + len(response) - 1
            routed = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(rows * 2)])
            samples.append(
                RolloutSample(
                    prompt,
                    response,
                    torch.full((len(response),), -1.0),
                    "stop",
                    "0",
                    routed_experts=routed.view(rows, 2, 2).to(torch.uint8),
                    group_index=g,
                    reward=float((g + i) % 2 == 0),
                )
            )
    batch = RolloutBatch.from_samples(samples, G)
    advantages, _ = compute_group_advantages(batch.rewards, G)
    return batch, advantages


def drift(a, b):
    """Per layer, mean over tokens of the share of a token's k experts that changed (by sets)."""
    k = a.shape[-1]
    changed = torch.zeros(a.shape[1], dtype=torch.float64)
    for t in range(a.shape[0]):
        for j in range(a.shape[1]):
            changed[j] += 1 - len(set(a[t, j].tolist()) & set(b[t, j].tolist())) / k
    return changed, a.shape[0]


def expected_drift(old, new, samples):
    changed, tokens = torch.zeros(2, dtype=torch.float64), 0
    for s in samples:
        c, n = drift(old[s], new[s])
        changed, tokens = changed + c, tokens + n
    return changed / tokens


def sgd_that_moves_nothing(model):
    return build_optimizer(model, OptimConfig(optimizer="sgd", lr=1e-30, clip_grad=0.0))


def test_drift_metrics_equal_the_drift_made_on_purpose(model):
    batch, advantages = make_batch()
    plan = plan_mini_batches(batch, advantages, MINI, DataLayout(micro_batch_size=2))
    micro_batches = [micro for mini in plan for micro in mini]
    log = RouterLog(model)  # the model's own routing, before anything is perturbed
    with torch.no_grad():
        run_micro_batches(model, [m.packed for m in micro_batches], lambda i, lp, _e: (lp.sum(), {}),
                          forward_only=True)  # fmt: skip
    log.close()
    own = log.per_sample(micro_batches)
    # The rollout engine's routing: the model's own, with one expert replaced on purpose in
    # token 0, layer 0 of every other sample.
    replaced = 0
    for s in range(len(batch.routed_experts)):
        routes = own[s].clone()
        if s % 2 == 0:
            taken = set(routes[0, 0].tolist())
            routes[0, 0, 0] = min(set(range(8)) - taken)
            replaced += 1
        batch.routed_experts[s] = routes.to(torch.uint8)
    routed_tokens = sum(len(r) for r in own.values())

    routing = StepRouting(model, mode="none", drift=True)
    routing.set_step(1)
    routing.begin_step(batch)
    old_log = RouterLog(model)
    recompute_old_logprobs(model, plan, T, routing=routing)
    old_log.close()
    with torch.no_grad():  # layer 1's router moves between pi_old and the update; layer 0's does not
        router = moe_routers(model)[1]
        router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(9)))
    new_log = RouterLog(model)
    optimizer, scheduler = sgd_that_moves_nothing(model)
    algo = AlgorithmConfig(loss_type="grpo", num_mini_batches=MINI)
    metrics = train_on_batch(
        model, optimizer, scheduler, plan, algo, temperature=T, max_response_length=8, routing=routing
    )
    new_log.close()
    routing.close()

    old, new = old_log.per_sample(micro_batches), new_log.per_sample(micro_batches)
    assert all(torch.equal(old[s], own[s]) for s in own)  # the pi_old pass routed as the model did
    first = [s for micro in plan[0] for s in micro.indices]
    later = [s for mini in plan[1:] for micro in mini for s in micro.indices]
    want_later, want_first = expected_drift(old, new, later), expected_drift(old, new, first)
    assert want_later[0] == 0.0 and want_later[1] > 0.1  # the perturbation reached layer 1 only
    assert metrics["drift/old_new/layer_0"] == 0.0
    assert metrics["drift/old_new/layer_1"] == pytest.approx(float(want_later[1]), abs=1e-6)
    assert metrics["drift/old_new/mean"] == pytest.approx(float(want_later.mean()), abs=1e-6)
    assert metrics["drift/old_new_mb0/mean"] == pytest.approx(float(want_first.mean()), abs=1e-6)
    # Inference -> training: exactly the replaced entries, one of k = 2 experts each.
    assert metrics["drift/infer_train/layer_0"] == pytest.approx(replaced / 2 / routed_tokens, abs=1e-6)
    assert metrics["drift/infer_train/layer_1"] == 0.0
    assert metrics["drift/infer_train/tokens_changed"] == pytest.approx(replaced / routed_tokens, abs=1e-6)


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_routing_replay_uses_routing_recorded_outside_the_code(model, mode):
    batch, advantages = make_batch()  # random rollout routing, unlike anything the router picks
    plan = plan_mini_batches(batch, advantages, MINI, DataLayout(micro_batch_size=2))
    routing = StepRouting(model, mode=mode, drift=False)
    routing.begin_step(batch)
    old_log = RouterLog(model)
    recompute_old_logprobs(model, plan, T, routing=routing)
    old_log.close()
    with torch.no_grad():  # without replay most tokens would now route elsewhere
        for router in moe_routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(9)))
    log = RouterLog(model)
    optimizer, scheduler = sgd_that_moves_nothing(model)
    algo = AlgorithmConfig(loss_type="grpo", num_mini_batches=MINI, routing_replay=mode)
    train_on_batch(
        model, optimizer, scheduler, plan, algo, temperature=T, max_response_length=8, routing=routing
    )
    log.close()
    routing.close()
    micro_batches = [micro for mini in plan for micro in mini]
    if mode == "r2":
        want = old_log.per_sample(micro_batches)
    else:
        want = {s: routes.long() for s, routes in enumerate(batch.routed_experts)}
    recomputes = any(rec for _, rec, _ in log.calls)  # backward recomputes, when the model has them
    for recompute in (False, True) if recomputes else (False,):
        used = log.per_sample(micro_batches, recompute=recompute)
        for s, routes in want.items():
            assert torch.equal(used[s].sort(-1).values, routes.sort(-1).values), (s, recompute)
    # The check can fail: the perturbed routers left to themselves choose otherwise.
    free = RouterLog(model)
    with torch.no_grad():
        run_micro_batches(model, [m.packed for m in micro_batches], lambda i, lp, _e: (lp.sum(), {}),
                          forward_only=True)  # fmt: skip
    free.close()
    own = free.per_sample(micro_batches)
    assert sum(int((own[s].sort(-1).values != want[s].sort(-1).values).any(-1).sum()) for s in want) > 10
