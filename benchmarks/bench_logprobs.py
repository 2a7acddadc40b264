"""Per-token log-probs: memory and time of our path against the naive log_softmax path.

    python benchmarks/bench_logprobs.py [--vocab 32768] [--batch 8] [--seq 128]

1. Peak extra memory while computing per-token log-probs of given tokens from the
   output-layer logits [S, B, V], as a fraction of the logits tensor's size, fp32 and bf16
   logits (goal <= 0.25):
   ours (`chunked_vocab_parallel_cross_entropy`: megatron's vocab-parallel cross entropy on
   token chunks, what `model/logprobs.py` uses through GPTModel's `labels` path) vs
   megatron's `vocab_parallel_cross_entropy` on the whole tensor (upcast to fp32 and kept as
   the softmax) vs `log_softmax(logits).gather(...)`. Memory in use is
   read from glibc's allocator (mallinfo2) after every torch op, so the peak includes every
   op's outputs; forward and forward+backward are reported separately (backward must
   materialise d(loss)/d(logits), a full-size tensor, on any path).
2. Forward+backward time of the tiny MoE policy at B x S through `sequence_logprobs`
   against the same model returning logits followed by the naive path, as a ratio measured
   in one run (interleaved repeats, medians).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def bytes_in_use() -> int:
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakMemory(TorchDispatchMode):
    """Tracks the allocator's peak bytes in use, sampled after every torch op."""

    def __enter__(self):
        self.start = bytes_in_use()
        self.peak = self.start
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, bytes_in_use())
        return out


def ours(logits, targets):
    from megatron_gspo.model.chunked_cross_entropy import chunked_vocab_parallel_cross_entropy

    return -chunked_vocab_parallel_cross_entropy(logits, targets)


def megatron(logits, targets):
    from megatron.core import tensor_parallel

    return -tensor_parallel.vocab_parallel_cross_entropy(logits, targets)


def naive(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def memory_fraction(method, seq, batch, vocab, hidden=64, dtype=torch.float32) -> tuple[float, float]:
    """(forward peak extra, forward+backward peak extra) / bytes of the `dtype` logits."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(seq, batch, hidden, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (seq, batch), generator=gen)
    logits_bytes = seq * batch * vocab * dtype.itemsize
    logits = h @ w.t()  # the output layer: logits are an intermediate the path may consume
    with PeakMemory() as fwd:
        loss = method(logits, targets).sum()
        del logits
    forward = (fwd.peak - fwd.start) / logits_bytes
    with PeakMemory() as bwd:
        loss.backward()
    total = max(forward, (bwd.peak - fwd.start) / logits_bytes)
    return forward, total


def timing_ratio(batch, seq, repeats) -> tuple[float, float, float]:
    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.config import tiny
    from megatron_gspo.model.distributed import ParallelConfig, init_distributed
    from megatron_gspo.model.logprobs import sequence_logprobs

    parallel = ParallelConfig()
    init_distributed(parallel)
    model = build_model(tiny(vocab_size=128), parallel)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 128, (seq,), generator=gen) for _ in range(batch)]
    tokens = torch.stack(seqs)
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]
    positions = torch.arange(seq)[None].expand(batch, seq)

    def run_ours():
        logprobs, _ = sequence_logprobs(model, seqs)
        logprobs.sum().backward()

    def run_naive():
        logits = model(tokens, positions, mask)
        naive(logits[:, :-1], tokens[:, 1:]).sum().backward()

    times = {run_ours: [], run_naive: []}
    for _ in range(2):
        run_ours(), run_naive()
    for _ in range(repeats):
        for fn in times:
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - start)
    ours_ms, naive_ms = (statistics.median(times[f]) * 1e3 for f in (run_ours, run_naive))
    return ours_ms / naive_ms, ours_ms, naive_ms


def measure(quick: bool = False) -> dict[str, float]:
    """Peak extra memory / logits bytes of both paths in fp32 and bf16 (`logits [S, B, V]`)."""
    from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed

    seq, batch, vocab = (64, 4, 8192) if quick else (128, 8, 32768)
    out = {"seq": float(seq), "batch": float(batch), "vocab": float(vocab)}
    init_distributed(ParallelConfig())  # the vocab-parallel CE asks for its (one-rank) TP group
    try:
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            for name, method in (("ours", ours), ("megatron", megatron), ("naive", naive)):
                forward, total = memory_fraction(method, seq, batch, vocab, dtype=dtype)
                out[f"{name}_{dtype_name}_forward"] = forward
                out[f"{name}_{dtype_name}_forward_backward"] = total
    finally:
        destroy_distributed()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    ratio, ours_ms, naive_ms = timing_ratio(args.batch, args.seq, args.repeats)  # also starts the world
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        shape = f"[S={args.seq}, B={args.batch}, V={args.vocab}]"
        print(f"peak extra memory / logits bytes, logits {shape} {dtype_name}:")
        for name, method in (
            ("ours (chunked vocab-parallel CE)", ours),
            ("megatron's vocab-parallel CE", megatron),
            ("naive log_softmax + gather", naive),
        ):
            forward, total = memory_fraction(method, args.seq, args.batch, args.vocab, dtype=dtype)
            print(f"  {name:36s} forward {forward:5.2f}   forward+backward {total:5.2f}")
    print(
        f"tiny MoE forward+backward B{args.batch}xS{args.seq}: ours / naive time = {ratio:.3f} "
        f"({ours_ms:.1f} ms vs {naive_ms:.1f} ms, medians of {args.repeats})"
    )


if __name__ == "__main__":
    main()
