"""torchrun worker of the data-parallel token-budget test (see test_token_budget_dp.py).

    python -m torch.distributed.run --standalone --nproc_per_node 2 budget_worker.py --hf DIR --result DIR

Two ranks, expert parallel 2 (so data parallel 2: the ranks exchange tokens in every MoE
layer and must run the same number of micro-batches). From the same HF weights, one RL
update (pi_old recomputed, SGD) of the same batch twice: cut by count (strided rows, a rank's
whole mini-batch per micro-batch) and by a token budget (rows balanced over the ranks by
tokens, several micro-batches of different sizes). Each rank writes the metrics, its cut and
how far its updated weights moved between the two to DIR/rank{r}.json; rank 0 also saves the
dense weights of the token-budget update to DIR/dense.pt for a world-of-one reference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.algorithms import compute_group_advantages
from megatron_gspo.config import AlgorithmConfig
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.convert import load_hf_checkpoint
from megatron_gspo.model.distributed import (
    ParallelConfig,
    compute_device,
    destroy_distributed,
    init_distributed,
)
from megatron_gspo.model.optim import OptimConfig, build_optimizer, wrap_ddp
from megatron_gspo.rollout import RolloutBatch, RolloutSample
from megatron_gspo.training.batch_scatter import scatter_rank_rows
from megatron_gspo.training.micro_batching import DataLayout
from megatron_gspo.training.update import plan_metrics, plan_rank_rows, recompute_and_measure, train_on_batch

G, GROUPS, MINI, T, LR, MAX_RESPONSE, BUDGET = 4, 4, 2, 0.7, 0.1, 40, 48
MODEL = tiny(vocab_size=80)


def make_batch() -> tuple[RolloutBatch, torch.Tensor]:
    """Groups of 2..6-token prompts and 1..40-token responses (a few long, most short)."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for g in range(GROUPS):
        prompt = torch.randint(3, 80, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen)
        for _ in range(G):
            long = bool(torch.rand((), generator=gen) < 0.3)
            r = int(torch.randint(20 if long else 1, (MAX_RESPONSE if long else 8) + 1, (1,), generator=gen))
            samples.append(
                RolloutSample(
                    prompt,
                    torch.randint(3, 80, (r,), generator=gen),
                    torch.zeros(r),
                    "stop",
                    "0",
                    group_index=g,
                    reward=float(torch.rand((), generator=gen) > 0.5),
                )
            )
    batch = RolloutBatch.from_samples(samples, G)
    advantages, _ = compute_group_advantages(batch.rewards, G)
    return batch, advantages


def build(parallel: ParallelConfig, hf: str) -> torch.nn.Module:
    """The tiny policy with the HF weights, DDP-wrapped."""
    model = build_model(MODEL, parallel)
    load_hf_checkpoint(model, hf, MODEL)
    return wrap_ddp(model)


def update(model, batch, advantages, layout: DataLayout, *, rank0: bool) -> tuple[dict, list]:
    """One RL update of the batch under `layout`; (metrics, this rank's rows per micro-batch)."""
    optimizer, scheduler = build_optimizer(model, OptimConfig(optimizer="sgd", lr=LR, clip_grad=0.0))
    algo = AlgorithmConfig(loss_type="gspo", num_mini_batches=MINI, old_logprobs="recompute")
    rows = scatter_rank_rows(
        batch if rank0 else None,
        advantages if rank0 else None,
        num_mini_batches=MINI,
        layout=layout,
        routed_experts=False,
        device=compute_device(),
    )
    plan = plan_rank_rows(rows, MINI, layout)
    metrics = {**recompute_and_measure(model, plan, T), **plan_metrics(plan)}
    metrics.update(
        train_on_batch(model, optimizer, scheduler, plan, algo, temperature=T, max_response_length=1)
    )
    return metrics, rows.micro_batch_sizes


def weights(model) -> dict[str, torch.Tensor]:
    """This rank's parameters (its experts' shard included)."""
    return {k: v.detach().clone() for k, v in model.module.state_dict().items() if torch.is_tensor(v)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    init_distributed(ParallelConfig(expert_parallel=2), seed=3)
    rank = dist.get_rank()
    model = build(ParallelConfig(expert_parallel=2), args.hf)
    batch, advantages = make_batch()
    start = weights(model)
    out = {}
    after = {}
    for name, budget in (("count", 0), ("budget", BUDGET)):
        layout = DataLayout.from_megatron(0, 1, max_tokens_per_micro_batch=budget)
        metrics, sizes = update(model, batch, advantages, layout, rank0=rank == 0)
        after[name] = weights(model)
        out[name] = {"metrics": metrics, "micro_batch_sizes": sizes}
        with torch.no_grad():
            for k, v in model.module.state_dict().items():
                if k in start:
                    v.copy_(start[k])
    out["moved"] = max(float((after["count"][k] - start[k]).abs().max()) for k in start)
    out["count_vs_budget"] = max(float((after["count"][k] - after["budget"][k]).abs().max()) for k in start)
    if rank == 0:
        dense = {k: v for k, v in after["budget"].items() if "experts" not in k}
        torch.save(dense, Path(args.result, "dense.pt"))
    Path(args.result, f"rank{rank}.json").write_text(json.dumps(out))
    destroy_distributed()


if __name__ == "__main__":
    main()
