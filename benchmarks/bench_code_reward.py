"""Programs per second of the code reward's pool: sandboxed runs through `CodeScorer`, by worker count.

    python benchmarks/bench_code_reward.py [--programs 64 --workers 1 2 4 --kind function]

Each program is distinct (a numbered comment defeats the pool's de-duplication) and correct, so
every test runs: `function` programs take one sandbox for their 5 tests (the CPU demo's shape),
`stdin` programs one sandbox per test (3 tests). Every run is a fresh bubblewrap sandbox
(user, PID, network, IPC and UTS namespaces, its own tmpfs) around a fresh interpreter, which is
the cost measured; the programs themselves do almost nothing.
"""

import argparse
import time

from megatron_gspo.tasks.code.cases import parse_tests
from megatron_gspo.tasks.code.reward import CodeScorer, ScoringOptions
from megatron_gspo.tasks.code.sandbox import Limits

FUNCTION = parse_tests(
    {"inputs": [[x] for x in (0, 1, 2, 5, -3)], "outputs": [3, 5, 7, 13, -3], "fn_name": "f"}
)
STDIN = parse_tests({"inputs": ["1 2\n", "3 4\n", "0 0\n"], "outputs": ["3\n", "7\n", "0\n"]})
PROGRAMS = {
    "function": (FUNCTION, "def f(x): return 2*x+3  # {i}"),
    "stdin": (STDIN, "a, b = map(int, input().split())\nprint(a + b)  # {i}"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--programs", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--kind", choices=sorted(PROGRAMS), default="function")
    args = parser.parse_args()
    tests, source = PROGRAMS[args.kind]
    runs_per_program = 1 if tests.fn_name else len(tests)
    print(f"{args.programs} distinct {args.kind} programs, {len(tests)} tests each, "
          f"{runs_per_program} sandboxed run(s) per program")  # fmt: skip
    for workers in args.workers:
        scorer = CodeScorer(ScoringOptions(limits=Limits(cpu_s=2, wall_s=10.0)), workers)
        scorer.score_many([(source.format(i=-1), tests)])  # start the pool and probe the sandbox
        jobs = [(source.format(i=i), tests) for i in range(args.programs)]
        start = time.perf_counter()
        results = scorer.score_many(jobs)
        seconds = time.perf_counter() - start
        scorer.close()
        assert all(r.reward == 1.0 for r in results), [r for r in results if r.reward != 1.0][:3]
        runs = args.programs * runs_per_program
        print(f"  workers {workers}: {args.programs / seconds:6.1f} programs/s "
              f"({runs / seconds:6.1f} sandboxed runs/s, {seconds:.1f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
