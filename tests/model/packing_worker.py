"""Packing at TP2 with sequence parallelism (run under torchrun --nproc_per_node=2).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/model/packing_worker.py --out R

Every rank writes `<out>.rank<r>.json`: max |packed - one sample per row| of the log-probs for the
mask layout and the THD row (each sequence padded to a multiple of TP; local-spec mask fallback),
and for R3 replay of per-sample routing into this rank's SP slice of the THD row.
"""

import argparse
import json

import torch
import torch.distributed as dist

from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.logprobs import packed_forward, sequence_logprobs
from megatron_gspo.model.packing import pack_sequences, unpack
from megatron_gspo.model.routing import RoutingReplay, routing_from_rollout

TP = 2


def max_diff(packed, alone):
    return max((packed[b, : len(a)] - a).abs().max().item() for b, a in enumerate(alone))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    parallel = ParallelConfig(tensor_parallel=TP)
    init_distributed(parallel, seed=5)
    rank = dist.get_rank()
    cfg = tiny(vocab_size=64, init_std=0.2)
    model = build_model(cfg, parallel, routing_replay=True).eval()
    gen = torch.Generator().manual_seed(3)  # TP ranks share the data
    seqs = [torch.randint(3, cfg.vocab_size, (n,), generator=gen) for n in (9, 14, 5, 11, 7, 12)]
    routes = [
        torch.rand(len(s) - 1, cfg.num_layers, cfg.num_experts, generator=gen).argsort(-1)[
            ..., : cfg.moe_topk
        ]
        for s in seqs
    ]
    sp = {"tp_rank": rank % TP, "tp_size": TP, "sequence_parallel": True}
    result = {}
    with torch.no_grad():
        alone = [sequence_logprobs(model, [s], layout="mask", pad_multiple=TP)[0][0] for s in seqs]
        for layout in ("mask", "thd"):
            packed, _ = sequence_logprobs(model, seqs, layout=layout, pad_multiple=TP)
            result[layout] = max_diff(packed, alone)
        thd = pack_sequences(seqs, layout="thd", pad_multiple=TP)
        result["thd_shape"] = list(thd.tokens.shape)
        with RoutingReplay(model) as replay:
            with replay.replaying(routing_from_rollout(thd, routes, num_experts=cfg.num_experts, **sp)):
                together = unpack(packed_forward(model, thd)[0], thd)
            free = unpack(packed_forward(model, thd)[0], thd)
            replayed_alone = []
            for seq, route in zip(seqs, routes):
                single = pack_sequences([seq], pad_multiple=TP)
                target = routing_from_rollout(single, [route], num_experts=cfg.num_experts, **sp)
                with replay.replaying(target):
                    replayed_alone.append(unpack(packed_forward(model, single)[0], single)[0])
    result["r3_thd"] = max_diff(together, replayed_alone)
    result["r3_changes_result"] = (free - together).abs().max().item()
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
