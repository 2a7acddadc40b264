"""torchrun worker of the KL-loss parallel test (see test_reference_multiprocess.py).

    python -m torch.distributed.run --standalone --nproc_per_node 2 kl_worker.py \
        --hf DIR --ref DIR --tp 2 --ep 1 --result FILE

From the same HF weights (policy) and a second checkpoint (reference), one RL update of the same
batch with the KL loss on (pi_old recomputed, reference log-probs in the same pass, SGD), once
per KL estimator, and once with ROLL's reward-side KL (gspo_token, token-level advantages
whitened over the data-parallel ranks), the policy restored in between. Rank 0 writes the
metrics per estimator to FILE; a world of one (`run` in the test's own process) gives the
numbers the layouts must reproduce.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # torchrun runs this file by path

from rl_update_common import LR, MINI, MODEL, T, build_policy, rank_plan  # noqa: E402
from rl_update_common import make_batch as make_groups  # noqa: E402

from megatron_gspo.algorithms.token_kl import KLController
from megatron_gspo.config import AlgorithmConfig
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.engine import EngineConfig
from megatron_gspo.model.optim import OptimConfig, build_optimizer
from megatron_gspo.training.reference import ReferencePolicy
from megatron_gspo.training.step.micro_batches import DataLayout
from megatron_gspo.training.step.token_kl import apply_token_level_kl
from megatron_gspo.training.step.update import recompute_and_measure, train_on_batch

ESTIMATORS = ("k1", "k2", "k3")
KEYS = ("actor/kl_ref", "actor/kl_ref_first_mb", "actor/kl_loss", "actor/pg_loss", "train/grad_norm")
TOKEN_KL_KEYS = ("critic/kl", "actor/pg_loss", "train/grad_norm")


def make_batch():
    """Groups of 2..6-token prompts and 1..8-token responses with 0/1 rewards."""
    return make_groups(lambda gen: int(torch.randint(1, 9, (1,), generator=gen)))


def run(parallel: ParallelConfig, hf: str, ref_hf: str) -> dict[str, dict[str, float]]:
    """The update under `parallel` for every estimator (call after `init_distributed`)."""
    reference = ReferencePolicy(MODEL, parallel, EngineConfig())
    reference.load(ref_hf)
    policy = build_policy(parallel, hf)
    start = {k: v.detach().clone() for k, v in policy.module.named_parameters()}
    batch, advantages = make_batch()
    sp = parallel.tensor_parallel if parallel.use_sequence_parallel else 1
    out = {}
    for estimator in (*ESTIMATORS, "token_kl"):
        with torch.no_grad():
            for k, v in policy.module.named_parameters():
                v.copy_(start[k])
        layout = DataLayout.from_megatron(0, sp)
        plan, _ = rank_plan(batch, advantages, layout)
        recompute_and_measure(policy, plan, T, reference=reference)
        optimizer, scheduler = build_optimizer(policy, OptimConfig(optimizer="sgd", lr=LR, clip_grad=0.0))
        if estimator == "token_kl":
            from megatron.core import parallel_state as ps

            algo = AlgorithmConfig(
                loss_type="gspo_token", num_mini_batches=MINI, old_logprobs="recompute",
                add_token_level_kl=True, whiten_advantages=True, advantage_clip=2.0,
            )  # fmt: skip
            kl = apply_token_level_kl(policy, plan, algo, KLController(0.5), ps.get_data_parallel_group())
        else:
            algo = AlgorithmConfig(
                loss_type="gspo", num_mini_batches=MINI, old_logprobs="recompute", use_kl_loss=True,
                kl_loss_coef=0.5, kl_estimator=estimator,
            )  # fmt: skip
        metrics = train_on_batch(
            policy, optimizer, scheduler, plan, algo, temperature=T, max_response_length=8
        )
        if estimator == "token_kl":
            out[estimator] = {"critic/kl": kl["critic/kl"], **{k: metrics[k] for k in TOKEN_KL_KEYS[1:]}}
        else:
            out[estimator] = {k: metrics[k] for k in KEYS}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--hf", "--ref", "--result"):
        parser.add_argument(name, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    args = parser.parse_args()
    parallel = ParallelConfig(tensor_parallel=args.tp, expert_parallel=args.ep)
    init_distributed(parallel, seed=3)
    out = run(parallel, args.hf, args.ref)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(out))
    destroy_distributed()


if __name__ == "__main__":
    main()
