"""What the math reward's fast exact path saves: microseconds per answer, fast path vs math-verify.

    python benchmarks/bench_math_reward.py [--answers 400 --repeats 3]

GSM8K-shaped pairs (integer references, completions right half the time, some with thousands
separators or a trailing unit), the common case of a math RL step. `fast` is `answers_match`
as the reward runs it (normalise, then equal strings or equal fractions, math-verify only for
what that cannot decide); `math_verify` is `parse` + `verify` on every pair (the reference's
parse cached, as the reward caches it). Both must give
the same verdicts; the ratio is measured in one run, alternating the two.
"""

import argparse
import random
import time

from megatron_gspo.tasks.math.reward import answers_match, math_verify_equal


def gsm8k_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prediction, reference): integers, half of them right, spelled as models write them."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        ref = rng.randrange(1, 100_000)
        pred = ref if rng.random() < 0.5 else ref + rng.choice([-10, -1, 1, 7, 100])
        spelled = rng.choice([str(pred), f"{pred:,}", f"{pred} dollars", f"\\${pred}"])
        pairs.append((spelled, str(ref)))
    return pairs


def per_answer_us(fn, pairs) -> tuple[float, list[bool]]:
    start = time.perf_counter()
    verdicts = [fn(p, r) for p, r in pairs]
    return (time.perf_counter() - start) / len(pairs) * 1e6, verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--answers", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    pairs = gsm8k_pairs(args.answers)
    math_verify_equal(*pairs[0])  # import and warm math-verify's caches outside the timing
    fast_us, mv_us = [], []
    for _ in range(args.repeats):
        t_fast, fast = per_answer_us(answers_match, pairs)
        t_mv, slow = per_answer_us(math_verify_equal, [(p.replace(" dollars", ""), r) for p, r in pairs])
        assert fast == slow, "fast path and math-verify disagree"
        fast_us.append(t_fast)
        mv_us.append(t_mv)
    fast_best, mv_best = min(fast_us), min(mv_us)
    print(f"{len(pairs)} GSM8K-shaped answers, best of {args.repeats}:")
    print(f"  fast path    {fast_best:8.1f} us/answer")
    print(f"  math-verify  {mv_best:8.1f} us/answer")
    print(f"  ratio        {mv_best / fast_best:8.1f}x")


if __name__ == "__main__":
    main()
