"""Routing replay under a pipeline (PP2, 1F1B, full activation recompute); run under torchrun.

    torchrun --nproc_per_node=2 tests/model/pp_routing_worker.py --out result.json

A forward hook on every router of this stage files what the router actually used, split into
forwards and backward recomputes (1F1B runs each stage's backwards in micro-batch order).
Every rank writes `<out>.rank<r>.json`:
- `keyed`: `KeyedReplay` with random per-micro-batch targets (unlike anything the router would
  pick): per local layer and micro-batch, whether the forward and the recompute used them;
- `wrong_key`: the same with the classic bug, backward replay keyed by the last forwarded
  micro-batch instead of the one being recomputed (must be caught on the first stage);
- `r2` / `r3`: `recompute_old_logprobs` + `train_on_batch` with `StepRouting` after a heavy
  router perturbation: used == what the routers chose in the pi_old pass (R2, recorded by the
  hook) / the rollout's routing placed by the packing's segments here (R3), per layer and
  micro-batch.
"""

import argparse
import json

import torch
import torch.distributed as dist

from megatron_gspo.algorithms import compute_group_advantages
from megatron_gspo.config import AlgorithmConfig
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.engine import EngineConfig
from megatron_gspo.model.optim import OptimConfig, build_optimizer, wrap_ddp
from megatron_gspo.model.packing import pack_sequences
from megatron_gspo.model.pipeline import run_micro_batches
from megatron_gspo.model.routing import RoutingReplay, moe_routers, routing_map_to_indices
from megatron_gspo.model.routing_hooks import KeyedReplay
from megatron_gspo.rollout import RolloutBatch, RolloutSample
from megatron_gspo.training.step.micro_batches import DataLayout, flatten, split_batch
from megatron_gspo.training.step.routing import StepRouting
from megatron_gspo.training.step.scatter import RankRows
from megatron_gspo.training.step.update import plan_rank_rows, recompute_old_logprobs, train_on_batch

VOCAB, E, K = 48, 8, 2
MICRO_BATCHES = 4  # stage 0 of PP2 has one forward in flight before each backward


class UsedRouting:
    """What every local router used, per call: (in a backward recompute?, [tokens, k] ids)."""

    def __init__(self, model):
        self.events = [[] for _ in moe_routers(model)]
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(moe_routers(model))]

    def _hook(self, layer):
        def hook(module, inputs, output):
            recompute = torch._C._current_graph_task_id() != -1
            self.events[layer].append((recompute, routing_map_to_indices(output[1], K).cpu()))

        return hook

    def split(self):
        """Per local layer: (forward routings in call order, recompute routings in call order)."""
        return [([r for b, r in layer if not b], [r for b, r in layer if b]) for layer in self.events]

    def close(self):
        for h in self.handles:
            h.remove()


def random_routing(tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])


def same(used, target):
    """Whether `used` chose `target`'s experts on every token `target` names (-1: not compared)."""
    target = target.to(torch.long)
    named = (target >= 0).all(dim=1)
    assert named.sum() > 0
    return bool(torch.equal(used[named].sort(dim=1).values, target[named].sort(dim=1).values))


def compare(split, targets_per_layer):
    """Per local layer: forward / recompute used == targets, micro-batch by micro-batch."""
    out = []
    for (forward, recompute), targets in zip(split, targets_per_layer):
        out.append(
            {
                "forwards": len(forward),
                "recomputes": len(recompute),
                "forward_ok": [same(u, t) for u, t in zip(forward, targets)],
                "recompute_ok": [same(u, t) for u, t in zip(recompute, targets)],
            }
        )
    return out


class LastForwardedReplay(KeyedReplay):
    """The bug keyed replay prevents: backward replays whatever micro-batch was forwarded last."""

    def before_forward(self, i):
        self.last = i
        super().before_forward(i)

    def before_backward(self, i):
        self.replay.select(self.layers(self.last).layers)


def keyed_check(model, replay, buggy):
    gen = torch.Generator().manual_seed(5)
    batches = [
        pack_sequences([torch.randint(3, VOCAB, (n,), generator=gen) for n in (7, 5, 9)])
        for _ in range(MICRO_BATCHES)
    ]
    tokens = [b.tokens.numel() for b in batches]
    layers = [n - 1 for n in replay.layer_numbers]
    targets = {i: [random_routing(tokens[i], 1000 * i + g) for g in layers] for i in range(MICRO_BATCHES)}
    from megatron_gspo.model.routing import LayerRouting

    cls = LastForwardedReplay if buggy else KeyedReplay
    hooks = cls(replay, lambda i: LayerRouting(targets[i]))
    used = UsedRouting(model)
    run_micro_batches(model, batches, lambda i, lp, _e: (lp.sum(), {}), forward_only=False, hooks=[hooks])
    used.close()
    replay.reset()
    per_layer = [[targets[i][j] for i in range(MICRO_BATCHES)] for j in range(len(layers))]
    return {"layers": replay.layer_numbers, "check": compare(used.split(), per_layer)}


def make_rows(model_cfg):
    gen = torch.Generator().manual_seed(3)
    samples = []
    for g in range(4):
        prompt = torch.randint(3, VOCAB, (3 + g,), generator=gen)
        for _ in range(2):
            response = torch.randint(
                3, VOCAB, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen
            )
            rows = len(prompt) + len(response) - 1
            routed = torch.stack(
                [
                    random_routing(model_cfg.num_layers, int(torch.randint(0, 10**6, (1,), generator=gen)))
                    for _ in range(rows)
                ]
            ).to(torch.uint8)  # [P + R - 1, layers, k]
            samples.append(
                RolloutSample(
                    prompt,
                    response,
                    torch.full((len(response),), -1.0),
                    "stop",
                    "0",
                    routed_experts=routed,
                    group_index=g,
                    reward=float(torch.rand((), generator=gen) > 0.5),
                )
            )
    batch = RolloutBatch.from_samples(samples, 2)
    advantages, _ = compute_group_advantages(batch.rewards, 2)
    layout = DataLayout(micro_batch_size=2)
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    rows, sizes = flatten(split_batch(lengths, 2, layout)[0])
    local = RankRows.from_batch(batch, advantages, rows, routed_experts=True, micro_batch_sizes=sizes)
    return local, layout


def rollout_routing(micro, rows, layer):
    """The rollout's routing of global `layer` in the router's token order (position-major over
    the packed rows), written out here from the packing's segments: routed tokens carry their
    sample's rows; padding and each sample's last token are compared as whatever sits there."""
    n_rows, length = micro.packed.tokens.shape
    out = torch.full((length, n_rows, K), -1, dtype=torch.long)
    for b, (row, start, n) in zip(micro.indices, micro.packed.segments):
        out[start : start + n - 1, row] = rows.routed_experts[b][:, layer].long()
    return out.view(length * n_rows, K)


def step_check(model, mode, model_cfg):
    ddp = model
    optimizer, scheduler = build_optimizer(ddp, OptimConfig(lr=1e-3))
    rows, layout = make_rows(model_cfg)
    plan = plan_rank_rows(rows, 2, layout)
    routing = StepRouting(ddp, mode=mode, drift=False)
    routing.begin_step(rows)
    recorded = UsedRouting(ddp)  # what the routers chose in the pi_old pass (R2's targets)
    recompute_old_logprobs(ddp, plan, 1.0, routing=routing)
    recorded.close()
    with torch.no_grad():  # the policy moved a lot: without replay most tokens would route elsewhere
        for router in moe_routers(ddp):
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(9)))
    used = UsedRouting(ddp)
    algo = AlgorithmConfig(loss_type="grpo", num_mini_batches=2, routing_replay=mode)
    train_on_batch(
        ddp, optimizer, scheduler, plan, algo, temperature=1.0, max_response_length=8, routing=routing
    )
    used.close()
    micro_batches = [micro for mini in plan for micro in mini]
    if mode == "r2":
        per_layer = [forward for forward, _ in recorded.split()]
    else:
        layers = [r.layer_number - 1 for r in moe_routers(ddp)]
        per_layer = [[rollout_routing(micro, rows, layer) for micro in micro_batches] for layer in layers]
    routing.close()
    own = UsedRouting(ddp)  # the perturbed router left to itself: replay had work to do
    with torch.no_grad():
        run_micro_batches(
            ddp, [m.packed for m in micro_batches], lambda i, lp, _e: (lp.sum(), {}), forward_only=True
        )
    own.close()
    differs = sum(
        int((u.sort(dim=1).values != t.sort(dim=1).values).any(dim=1).sum())
        for (forward, _), targets in zip(own.split(), per_layer)
        for u, t in zip(forward, targets)
    )
    return {"check": compare(used.split(), per_layer), "own_routing_differs": differs}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    parallel = ParallelConfig(pipeline_parallel=2)
    init_distributed(parallel, seed=7)
    model_cfg = tiny(vocab_size=VOCAB, init_std=0.2)
    engine = EngineConfig(recompute_activations=True)
    model = wrap_ddp(build_model(model_cfg, parallel, engine, routing_replay=True))
    result = {}
    with RoutingReplay(model) as replay:
        result["keyed"] = keyed_check(model, replay, buggy=False)
        result["wrong_key"] = keyed_check(model, replay, buggy=True)
    for mode in ("r2", "r3"):
        model = wrap_ddp(build_model(model_cfg, parallel, engine, routing_replay=True))
        result[mode] = step_check(model, mode, model_cfg)
    with open(f"{args.out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
