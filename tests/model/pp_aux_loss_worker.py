"""Aux-loss weights per micro-batch under PP2 (1F1B, recompute); run under torchrun with 2 ranks.

Only the aux loss backpropagates (the policy loss is the log-probs times 0). Every rank writes
`<out>.rank<r>.json` with the max |router grad - expected| of its stage, where expected is
sum_i scale_i x (micro-batch i alone at scale 1), for `AuxLossWeights` and, as the negative
control, for megatron's own schedule scale (1 / num_microbatches for every micro-batch).

`--virtual-pipeline 2`: two model chunks per stage (interleaved 1F1B). The 3 micro-batches then
run as 4 and each one alone as 4: filler micro-batches, copies of the last real one, whose
aux-loss gradient must be zero. A filler that added it would count micro-batch 3 once more in
the weighted run and each micro-batch 4 times alone: `weighted` would show it.
"""

import argparse
import json

import torch
import torch.distributed as dist

from megatron_gspo.model.aux_loss import AuxLossWeights, set_aux_loss_scale
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.engine import EngineConfig
from megatron_gspo.model.packing import pack_sequences
from megatron_gspo.model.pipeline import run_micro_batches

SCALES = [0.5, 2.0, 1.25]


def router_grads(model, batches, hooks):
    model.zero_grad(set_to_none=True)
    run_micro_batches(model, batches, lambda i, lp, _e: (lp.sum() * 0.0, {}), forward_only=False, hooks=hooks)
    return {n: p.grad.clone() for n, p in model.named_parameters() if "router" in n}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--virtual-pipeline", type=int, default=None)
    args = parser.parse_args()
    parallel = ParallelConfig(pipeline_parallel=2, virtual_pipeline=args.virtual_pipeline)
    init_distributed(parallel, seed=7)
    engine = EngineConfig(recompute_activations=True)
    arch = tiny(vocab_size=32, init_std=0.2, num_layers=2 * (args.virtual_pipeline or 1))
    model = build_model(arch, parallel, engine, aux_loss_coeff=0.5).train()
    gen = torch.Generator().manual_seed(0)
    batches = [pack_sequences([torch.randint(3, 32, (n,), generator=gen)]) for n in (5, 11, 8)]
    unit = [torch.tensor(1.0)]
    alone = [router_grads(model, [b], [AuxLossWeights(unit)]) for b in batches]
    expected = {n: sum(s * a[n] for s, a in zip(SCALES, alone)) for n in alone[0]}
    weighted = router_grads(model, batches, [AuxLossWeights([torch.tensor(s) for s in SCALES])])
    megatron = router_grads(model, batches, [])

    def err(got):
        return max(float((got[n] - expected[n]).abs().max()) for n in expected)

    result = {
        "grad_abs": max(float(g.abs().max()) for g in expected.values()),
        "weighted": err(weighted),
        "megatron_scale": err(megatron),
    }
    set_aux_loss_scale(torch.tensor(1.0))
    with open(f"{args.out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
