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
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # torchrun runs this file by path

from rl_update_common import LR, MINI, T, build_policy, rank_plan  # noqa: E402
from rl_update_common import make_batch as make_groups  # noqa: E402

from megatron_gspo.config import AlgorithmConfig
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.optim import OptimConfig, build_optimizer
from megatron_gspo.training.step.micro_batches import DataLayout
from megatron_gspo.training.step.update import plan_metrics, recompute_and_measure, train_on_batch

MAX_RESPONSE, BUDGET = 40, 48


def response_length(gen: torch.Generator) -> int:
    """1..8 tokens, or 20..40 for about a third of the responses."""
    long = bool(torch.rand((), generator=gen) < 0.3)
    return int(torch.randint(20 if long else 1, (MAX_RESPONSE if long else 8) + 1, (1,), generator=gen))


def make_batch():
    """Groups of 2..6-token prompts and 1..40-token responses (a few long, most short)."""
    return make_groups(response_length)


def update(model, batch, advantages, layout: DataLayout) -> tuple[dict, list]:
    """One RL update of the batch under `layout`; (metrics, this rank's rows per micro-batch)."""
    optimizer, scheduler = build_optimizer(model, OptimConfig(optimizer="sgd", lr=LR, clip_grad=0.0))
    algo = AlgorithmConfig(loss_type="gspo", num_mini_batches=MINI, old_logprobs="recompute")
    plan, rows = rank_plan(batch, advantages, layout)
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
    model = build_policy(ParallelConfig(expert_parallel=2), args.hf)
    batch, advantages = make_batch()
    start = weights(model)
    out = {}
    after = {}
    for name, budget in (("count", 0), ("budget", BUDGET)):
        layout = DataLayout.from_megatron(0, 1, max_tokens_per_micro_batch=budget)
        metrics, sizes = update(model, batch, advantages, layout)
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
