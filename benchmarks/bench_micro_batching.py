"""Padding waste and data-parallel imbalance per RL step: micro-batches by count vs by tokens.

    python benchmarks/bench_micro_batching.py [--responses 512 --dp 8 --mini-batches 4 --tp 4]

A reasoning-shaped step: responses of lognormal length (median 2k, clipped to 200..32k tokens)
to 100..1024-token prompts. Only the cut is computed (`split_batch`, what rank 0 runs each
step), no model: each micro-batch costs the THD positions of its packing (sequences padded to
a multiple of the TP size under sequence parallelism). Under the allgather dispatcher
(`--dispatcher allgather`) the ranks of an expert-parallel group (here all the DP ranks) also
pad their i-th micro-batches to the largest of them (`uniform_shape`), which is where a strided
count-based cut wastes most; under alltoall (the default) each keeps its own shape.

- before: `trainer.micro_batch_size` responses per micro-batch, rows strided over the ranks;
- after: `trainer.max_tokens_per_micro_batch`, rows balanced over the ranks by tokens.

Prints per cut: micro-batches per rank and mini-batch, the largest micro-batch (positions:
what sizes activation memory), padding (positions holding no token / all positions), the
DP imbalance (most / fewest tokens one rank trains on) and rank 0's planning time; then the
before/after ratios. Runs in seconds.

`measure` (benchmarks/run.py) adds the padding of the CPU demo's own cut
(configs/tiny_moe_cpu.yaml: its task's prompts, the reference answers + EOS as responses).
"""

import argparse
import math
import random
import time
from pathlib import Path

from megatron_gspo.training.step.micro_batches import DataLayout, split_batch

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_moe_cpu.yaml"


def lengths(responses: int, seed: int = 0) -> list[int]:
    """Prompt + response tokens of each row, a long tail of responses."""
    rng = random.Random(seed)
    rows = []
    for _ in range(responses):
        response = min(32_768, max(200, int(rng.lognormvariate(math.log(2000), 1.0))))
        rows.append(rng.randint(100, 1024) + response)
    return rows


def cut_stats(
    rows: list[int], mini: int, layout: DataLayout, dispatcher: str = "alltoall"
) -> dict[str, float]:
    """The cut's micro-batch count, largest micro-batch, padding and DP imbalance (see the docstring)."""
    start = time.perf_counter()
    splits = split_batch(rows, mini, layout)
    ms = (time.perf_counter() - start) * 1e3
    tokens = [sum(rows[i] for mb in split for micro in mb for i in micro) for split in splits]
    positions, largest, counts = 0, 0, set()
    for m in range(mini):
        for slot in zip(*(split[m] for split in splits), strict=True):  # equal counts on every rank
            shapes = [layout.cost([rows[i] for i in micro]) for micro in slot]
            if dispatcher == "allgather":  # uniform_shape (THD): every peer pads to the largest
                shapes = [max(shapes)] * len(shapes)
            positions += sum(shapes)
            largest = max(largest, *shapes)
        counts.add(len(splits[0][m]))
    return {
        "micro": sum(counts) / len(counts),
        "largest": largest,
        "padding": 1 - sum(tokens) / positions,
        "imbalance": max(tokens) / min(tokens),
        "ms": ms,
    }


def demo_padding(steps: int) -> float:
    """Padding fraction of the demo config's micro-batches over `steps` RL steps of its prompt stream."""
    from megatron_gspo.config import build_task, load_config
    from megatron_gspo.tasks import PromptStream
    from megatron_gspo.tasks.tokenizer import (
        build_char_tokenizer,
        encode_prompt,
        encode_text,
        resolve_add_bos,
    )

    cfg = load_config(DEMO_CONFIG)
    task, tokenizer = build_task(cfg), build_char_tokenizer()
    layout = DataLayout(
        micro_batch_size=cfg.trainer.micro_batch_size,
        max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch or 0,
    )
    stream = PromptStream(task, cfg.rollout.rollout_batch_size, seed=cfg.trainer.seed)
    tokens = positions = 0
    for _ in range(steps):
        rows = []
        for problem in stream.next_batch():
            prompt = encode_prompt(
                tokenizer, problem.prompt, add_bos=resolve_add_bos(cfg.task.add_bos, tokenizer)
            )
            rows += [len(prompt) + len(encode_text(tokenizer, problem.answer)) + 1] * cfg.rollout.group_size
        padding = cut_stats(rows, cfg.algorithm.num_mini_batches, layout)["padding"]
        tokens += sum(rows)
        positions += sum(rows) / (1 - padding)
    return 1 - tokens / positions


def measure(quick: bool = False) -> dict[str, float]:
    """Padding of the demo's cut, and of the reasoning-shaped step by count (4 rows) and by tokens."""
    rows = lengths(128 if quick else 512)
    base = DataLayout(dp_size=8, pad_multiple=4, packing="thd")
    # padding as the allgather dispatcher pads (alltoall: each micro-batch's own THD shape, ~0)
    by_count = cut_stats(rows, 4, DataLayout(**{**vars(base), "micro_batch_size": 4}), "allgather")
    by_tokens = cut_stats(
        rows, 4, DataLayout(**{**vars(base), "max_tokens_per_micro_batch": 36_864}), "allgather"
    )
    return {
        "demo_padding": demo_padding(5 if quick else 50),
        "reasoning_padding_by_count": by_count["padding"],
        "reasoning_padding_by_tokens": by_tokens["padding"],
        "reasoning_rows": float(len(rows)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--responses", type=int, default=512)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--mini-batches", type=int, default=4)
    parser.add_argument("--tp", type=int, default=4, help="sequence-parallel TP: THD sequences pad to it")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="the count-based cut (before)")
    parser.add_argument("--dispatcher", choices=["alltoall", "allgather"], default="alltoall")
    parser.add_argument(
        "--budget", type=int, default=36_864, help="the token-budget cut (after): >= 1024 + 32768"
    )
    args = parser.parse_args()
    rows = lengths(args.responses)
    per_rank = args.responses // (args.mini_batches * args.dp)
    print(
        f"{args.responses} responses ({sum(rows) / 1e6:.2f}M tokens, rows {min(rows)}..{max(rows)}, "
        f"median {sorted(rows)[len(rows) // 2]}), {args.mini_batches} mini-batches x DP={args.dp} "
        f"({per_rank} rows per rank), THD padded to TP={args.tp}, EP peers = the DP ranks, "
        f"{args.dispatcher} dispatcher"
    )
    base = DataLayout(dp_size=args.dp, pad_multiple=args.tp, packing="thd")
    cuts = {
        f"by count, {n} per micro-batch": DataLayout(**{**vars(base), "micro_batch_size": n})
        for n in sorted({1, args.micro_batch_size, per_rank})
    }
    for budget in (args.budget, 2 * args.budget, 4 * args.budget):
        cuts[f"by tokens, budget {budget}"] = DataLayout(
            **{**vars(base), "max_tokens_per_micro_batch": budget}
        )
    results = {}
    print(
        f"{'cut':34s} {'micro/rank':>10s} {'largest':>9s} {'padding':>8s} {'imbalance':>9s} {'plan ms':>8s}"
    )
    for name, layout in cuts.items():
        r = results[name] = cut_stats(rows, args.mini_batches, layout, args.dispatcher)
        print(
            f"{name:34s} {r['micro']:10.1f} {r['largest']:9d} {r['padding']:8.1%} "
            f"{r['imbalance']:9.3f} {r['ms']:8.1f}"
        )
    before = results[f"by count, {args.micro_batch_size} per micro-batch"]
    after = results[f"by tokens, budget {args.budget}"]
    ratio = before["padding"] / after["padding"]
    print(
        f"before (count {args.micro_batch_size}) / after (budget {args.budget}): padding "
        f"{before['padding']:.1%} -> {after['padding']:.1%} ({ratio:.1f}x less), DP imbalance "
        f"{before['imbalance']:.3f} -> {after['imbalance']:.3f}, largest micro-batch "
        f"{before['largest']} -> {after['largest']} positions ({before['largest'] / after['largest']:.2f}x)"
    )


if __name__ == "__main__":
    main()
