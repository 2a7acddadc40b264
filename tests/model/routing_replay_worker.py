"""Replay check on one TP x EP layout; run under torchrun (or plain python for world 1).

    python tests/model/routing_replay_worker.py --out result.json [--tp 2 --ep 2] [--recompute]

Every rank writes `<out>.rank<r>.json` with what it measured:
- layout: per-sample routing of the packed batch (gathered over SP) vs each sample run alone;
- tokens whose top-k changed after a heavy router perturbation without replay;
- whether replaying the recorded routing reproduced it exactly, and the router's grad norm.
"""

import argparse
import json

import torch
import torch.distributed as dist

from megatron_gspo.model import config as model_configs
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.engine import EngineConfig
from megatron_gspo.model.logprobs import pack_sequences, packed_forward
from megatron_gspo.model.routing import (
    RoutingCapture,
    RoutingReplay,
    gather_sequence_parallel,
    moe_routers,
    routing_to_samples,
    routing_token_mask,
)

LENGTHS = [9, 14, 5, 11, 7, 12]  # packed into rows of 16 (uniform shapes on every rank)
ROW_LEN = 16


def captured(model, packed, tp):
    with torch.no_grad(), RoutingCapture(model) as capture:
        packed_forward(model, packed)
    return gather_sequence_parallel(capture.routing())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    parallel = ParallelConfig(tensor_parallel=args.tp, expert_parallel=args.ep)
    init_distributed(parallel, seed=11)
    rank = dist.get_rank()
    cfg = model_configs.tiny(vocab_size=64, init_std=0.2)
    model = build_model(
        cfg, parallel, EngineConfig(recompute_activations=args.recompute), routing_replay=True
    )
    gen = torch.Generator().manual_seed(100 + rank // args.tp)  # TP ranks share data
    seqs = [torch.randint(3, cfg.vocab_size, (n,), generator=gen) for n in LENGTHS]
    packed = pack_sequences(seqs, row_len=ROW_LEN, pad_multiple=args.tp)
    sp = parallel.use_sequence_parallel
    tp_rank = rank % args.tp
    result = {"rows": packed.tokens.shape[0]}

    # Layout: packed routing, unpacked per sample == each sample alone in its own row.
    per_sample = routing_to_samples(packed, captured(model, packed, args.tp))
    alone_equal, alone_total = 0, 0
    for seq, routes in zip(seqs, per_sample):
        single = pack_sequences([seq], row_len=ROW_LEN, pad_multiple=args.tp)
        ref = routing_to_samples(single, captured(model, single, args.tp))[0]
        alone_equal += int((routes.sort(-1).values == ref.sort(-1).values).all(-1).sum())
        alone_total += ref.shape[0] * ref.shape[1]
    result["layout_equal"], result["layout_total"] = alone_equal, alone_total

    replay = RoutingReplay(model)
    with replay.recording() as recorded:
        with torch.no_grad():
            packed_forward(model, packed)
    mask = routing_token_mask(packed, tp_rank=tp_rank, tp_size=args.tp, sequence_parallel=sp)
    result["local_tokens"] = recorded.routing.num_tokens
    result["bytes_per_token"] = recorded.routing.bytes_per_token
    result["dtype"] = str(recorded.routing.layers[0].dtype)

    perturb = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=perturb) * 5.0)
    old = recorded.routing.stacked().sort(-1).values
    with torch.no_grad(), RoutingCapture(model) as capture:
        packed_forward(model, packed)
    free = capture.routing().stacked()
    result["tokens_changed_without_replay"] = int(((free != old).any(-1).any(-1) & mask).sum())
    result["tokens_valid"] = int(mask.sum())

    model.zero_grad(set_to_none=True)
    with replay.replaying(recorded.routing), RoutingCapture(model) as capture:
        logprobs, _ = packed_forward(model, packed)
        logprobs.sum().backward()
    forced = capture.routing().stacked()
    result["replay_exact"] = bool(torch.equal(forced, old))
    result["router_grad_norm"] = [float(r.weight.grad.norm()) for r in moe_routers(model)]
    replay.close()
    from megatron.core.transformer.moe.router_replay import RouterReplay

    result["instances_after_close"] = len(RouterReplay.global_router_replay_instances)
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
