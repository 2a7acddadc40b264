"""The CPU code demo over seeds: held-out pass rate before and after GSPO, and the share of step time scoring.

    python benchmarks/code_demo_seeds.py [--seeds 1 2 3] [--out runs/code_demo] [key=value ...]
    python benchmarks/code_demo_seeds.py --summarize runs/code_demo/seed1 runs/code_demo/seed2 ...

Trains `configs/code_tiny_cpu.yaml` once per seed (`trainer.seed`; extra arguments are config
overrides), one run after the other, then prints a row per run from its metrics.jsonl: the SFT
steps the cold start took, the greedy held-out pass rate (all five tests) at RL step 0 and at the
last step, and the mean share of RL step time spent scoring (`time/reward_s / time/step_s`).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def summary(run_dir: Path) -> dict:
    """SFT steps, pass rate before and after RL, and the scoring share of one finished run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "time/reward_s" in r and r.get("time/step_s")]
    share = sum(r["time/reward_s"] / r["time/step_s"] for r in steps) / max(len(steps), 1)
    sft = next((r["sft/steps"] for r in rows if "sft/steps" in r), float("nan"))
    return {"run": str(run_dir), "sft_steps": sft, "before": evals[0][1], "after": evals[-1][1],
            "rl_steps": evals[-1][0], "scoring_share": share}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "code_demo")
    parser.add_argument("--summarize", type=Path, nargs="+", help="only summarize these finished runs")
    args, overrides = parser.parse_known_args()
    runs = args.summarize or []
    if not runs:
        for seed in args.seeds:
            run_dir = args.out / f"seed{seed}"
            cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", "--config",
                   str(REPO / "configs" / "code_tiny_cpu.yaml"), f"trainer.seed={seed}",
                   f"trainer.run_dir={run_dir}", "logging.progress_bar=false", *overrides]  # fmt: skip
            subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
            runs.append(run_dir)
    print("| run | SFT steps | pass rate at cold start | after RL (step) | gain | step time scoring |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        s = summary(run)
        print(f"| {run.name} | {s['sft_steps']:.0f} | {s['before']:.3f} | {s['after']:.3f} ({s['rl_steps']}) "
              f"| {s['after'] - s['before']:+.3f} | {s['scoring_share']:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
