"""Bytes each rank receives per RL step: the whole pickled batch (before) vs its own rows (after).

    python benchmarks/bench_batch_scatter.py [--responses 512 --max-response 8192 --dp 8]

A synthetic Qwen3-30B-A3B-shaped step (48 MoE layers, top-8 of 128 experts, so routed experts
are uint8 `[P + R - 1, 48, 8]` per response), measured on the CPU by serialising, no network:

- before: `broadcast_object_list` of the whole `RolloutBatch` (routed experts included) reaches
  every rank, i.e. its pickle size per rank;
- after: `scatter_rank_rows` sends each data-parallel rank one buffer of its own rows, padded
  to the largest rank's (the scatter needs equal sizes), plus the pickled headers; routed
  experts only when R3 or a drift measurement needs them.

Prints both sizes per rank and their ratio; a run takes ~10 s and ~3.5 GB of RAM.
"""

import argparse
import pickle
import time

import torch

from megatron_gspo.rollout import RolloutBatch, RolloutSample
from megatron_gspo.training.step.micro_batches import dp_rows
from megatron_gspo.training.step.scatter import encode_rows

LAYERS, TOPK, GROUP = 48, 8, 16


def synthetic_batch(responses: int, max_response: int, seed: int = 0) -> tuple[RolloutBatch, torch.Tensor]:
    """Groups of `GROUP` responses of 1k..max_response tokens to 200..600-token prompts."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for g in range(responses // GROUP):
        prompt = torch.randint(
            0, 151_000, (int(torch.randint(200, 600, (1,), generator=gen)),), generator=gen
        )
        for _ in range(GROUP):
            r = int(torch.randint(1024, max_response + 1, (1,), generator=gen))
            routes = torch.empty(len(prompt) + r - 1, LAYERS, TOPK, dtype=torch.uint8).random_(
                0, 128, generator=gen
            )
            samples.append(
                RolloutSample(
                    prompt,
                    torch.randint(0, 151_000, (r,), generator=gen),
                    -torch.rand(r, generator=gen),
                    "stop",
                    "0",
                    routed_experts=routes,
                    group_index=g,
                    reward=float(torch.rand((), generator=gen) > 0.5),
                )
            )
    batch = RolloutBatch.from_samples(samples, GROUP)
    return batch, torch.randn(batch.batch_size, generator=gen)


def after_bytes(batch: RolloutBatch, advantages: torch.Tensor, dp: int, mini: int, routes: bool) -> int:
    """Bytes each rank receives with the per-rank scatter (padded buffer + the pickled headers)."""
    headers = []
    for d in range(dp):
        rows = dp_rows(batch.batch_size, mini, d, dp)
        header, buffer = encode_rows(
            batch, advantages, rows, routed_experts=routes, micro_batch_sizes=[[len(rows) // mini]] * mini
        )
        assert buffer.numel() == header.nbytes
        headers.append(header)
    return max(h.nbytes for h in headers) + len(pickle.dumps(headers))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--responses", type=int, default=512)
    parser.add_argument("--max-response", type=int, default=8192)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--mini-batches", type=int, default=4)
    args = parser.parse_args()
    start = time.perf_counter()
    batch, advantages = synthetic_batch(args.responses, args.max_response)
    tokens = int((batch.prompt_lengths + batch.response_lengths).sum())
    before = len(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
    no_routes = after_bytes(batch, advantages, args.dp, args.mini_batches, routes=False)
    with_routes = after_bytes(batch, advantages, args.dp, args.mini_batches, routes=True)
    print(
        f"{args.responses} responses, {tokens / 1e6:.2f}M tokens, {LAYERS} layers x top-{TOPK}, DP={args.dp}"
    )
    print(f"before: {before / 2**20:9.1f} MiB per rank per step (whole pickled batch incl. routed experts)")
    for name, size in (
        ("after, no routed experts", no_routes),
        ("after, with routed experts (R3/drift)", with_routes),
    ):
        print(
            f"{name + ':':40s} {size / 2**20:9.1f} MiB per rank per step (before/after {before / size:.1f}x)"
        )
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
