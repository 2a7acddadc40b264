"""Routing Replay cost: forward+backward step time with replay / without, and replay bytes per token.

    OMP_NUM_THREADS=2 python benchmarks/bench_routing_replay.py [--rows 8 --row-len 128 --iters 20]

Prints: plain step time, replayed step time (ratio; goal <= 1.05), the same plus the recording
forward R2 needs (no-grad pi_old pass), and the compact replay storage per token.
"""

import argparse
import time

import torch

from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.logprobs import pack_sequences, packed_forward
from megatron_gspo.model.routing import RoutingReplay


def step(model, packed):
    logprobs, _ = packed_forward(model, packed)
    logprobs.sum().backward()
    model.zero_grad(set_to_none=True)


def timed(fn, iters):
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]  # median


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--row-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    init_distributed(ParallelConfig(), seed=0)
    cfg = tiny(vocab_size=128, num_layers=args.layers)
    model = build_model(cfg, ParallelConfig(), routing_replay=True)
    gen = torch.Generator().manual_seed(0)
    packed = pack_sequences([torch.randint(3, 128, (args.row_len,), generator=gen) for _ in range(args.rows)])
    tokens = args.rows * args.row_len
    with RoutingReplay(model) as replay:
        with replay.recording() as rec, torch.no_grad():
            packed_forward(model, packed)
        routing = rec.routing

        def replayed():
            with replay.replaying(routing):
                step(model, packed)

        def record_then_replay():
            with replay.recording(), torch.no_grad():
                packed_forward(model, packed)
            replayed()

        plain_s, replay_s, both_s = 0.0, 0.0, 0.0
        for _ in range(3):  # interleave to cancel drift in machine load
            plain_s += timed(lambda: step(model, packed), args.iters)
            replay_s += timed(replayed, args.iters)
            both_s += timed(record_then_replay, args.iters)
        print(
            f"tiny MoE: {args.layers} layers, {cfg.num_experts} experts top-{cfg.moe_topk}, "
            f"{tokens} tokens/step"
        )
        print(f"forward+backward without replay: {plain_s / 3 * 1e3:.2f} ms")
        print(f"with replay: {replay_s / 3 * 1e3:.2f} ms  ratio {replay_s / plain_s:.3f} (goal <= 1.05)")
        print(f"with the recording forward (R2): {both_s / 3 * 1e3:.2f} ms  ratio {both_s / plain_s:.3f}")
        print(
            f"replay storage: {routing.bytes_per_token} bytes/token ({routing.layers[0].dtype}), "
            f"{routing.nbytes} bytes for the step; int32 as SGLang sends it: "
            f"{args.layers * cfg.moe_topk * 4} bytes/token"
        )
    destroy_distributed()


if __name__ == "__main__":
    main()
