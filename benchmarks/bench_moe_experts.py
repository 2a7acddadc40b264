"""The local experts' forward+backward: the `grouped_local_experts` patch over megatron's loop.

    OMP_NUM_THREADS=1 python benchmarks/bench_moe_experts.py [--quick]

One MoE layer's `SequentialMLP` of the demo (8 experts, H 64, F 32) and of the drift config
(32 experts), fed the permuted tokens of a demo-sized micro-batch (32 rows x 12 positions x
top-k, drawn uniformly over the experts). The same module runs both ways, interleaved within
each repeat: megatron's per-expert loop (the patch's saved original) and the two grouped
matmuls (bit-identical results: tests/patches/).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_train_step import paired_ratio, timed

SHAPES = {"demo": {"num_experts": 8, "moe_topk": 2}, "drift": {"num_experts": 32, "moe_topk": 4}}
TOKENS = 32 * 12


def _pass(experts, forward, hidden, counts, probs, calls: int):
    def run() -> None:
        for _ in range(calls):
            x, p = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
            out, _ = forward(experts, x, counts, p)
            out.sum().backward()

    return run


def measure(quick: bool = False) -> dict[str, float]:
    """Per shape: median ms of each way and their paired ratio (grouped / loop)."""
    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.config import tiny
    from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
    from megatron_gspo.patches import grouped_local_experts as grouped

    repeats, calls = (3, 5) if quick else (15, 50)
    init_distributed(ParallelConfig(), seed=0)  # applies the patches
    if "forward" not in grouped._ORIGINAL:
        raise RuntimeError("grouped_local_experts is not applied in this process (it applies on CPU only)")
    out: dict[str, float] = {"tokens": float(TOKENS)}
    try:
        for name, shape in SHAPES.items():
            experts = (
                build_model(tiny(vocab_size=80, **shape), ParallelConfig()).decoder.layers[0].mlp.experts
            )
            if not grouped.groupable(experts):
                raise RuntimeError("the tiny model's experts are not what grouped_local_experts replaces")
            generator = torch.Generator().manual_seed(0)
            rows = TOKENS * shape["moe_topk"]
            counts = torch.bincount(
                torch.randint(0, shape["num_experts"], (rows,), generator=generator),
                minlength=shape["num_experts"],
            )
            hidden = torch.randn(rows, 64, generator=generator)
            probs = torch.rand(rows, generator=generator)
            t = timed(
                {
                    "loop": _pass(experts, grouped._ORIGINAL["forward"], hidden, counts, probs, calls),
                    "grouped": _pass(experts, grouped.grouped_forward, hidden, counts, probs, calls),
                },
                repeats,
            )
            out[f"{name}_loop_ms"] = statistics.median(t["loop"]) * 1e3 / calls
            out[f"{name}_grouped_ms"] = statistics.median(t["grouped"]) * 1e3 / calls
            out[f"{name}_grouped_vs_loop"] = paired_ratio(t, "grouped", "loop")
    finally:
        destroy_distributed()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    result = measure(parser.parse_args().quick)
    for name in SHAPES:
        grouped_ms, loop_ms = result[f"{name}_grouped_ms"], result[f"{name}_loop_ms"]
        print(
            f"{name}: grouped / loop = {result[f'{name}_grouped_vs_loop']:.3f} "
            f"({grouped_ms:.2f} ms vs {loop_ms:.2f} ms per forward+backward)"
        )


if __name__ == "__main__":
    main()
