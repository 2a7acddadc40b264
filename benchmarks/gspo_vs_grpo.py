"""GSPO vs GRPO (with and without Routing Replay): the paper's comparison, on whatever config you give.

    python benchmarks/gspo_vs_grpo.py --seeds 1 2 3 --out runs/gspo_vs_grpo [--steps 100] [--jobs 1]

Each variant trains from the same cold start per seed (`megatron-gspo train`, drift metrics
on), then the harness reads every run's metrics.jsonl and writes `summary.md`, `summary.json`
and `accuracy.png`: held-out accuracy over steps (mean over seeds), final accuracy, clipped
token / sequence fractions (the paper: GSPO clips two orders of magnitude more tokens and
still learns better), old->new routing drift, and step time. On CPU the default variants use
the tiny demo configs; point `--variant name=config.yaml[,key=value...]` at GPU configs for
real runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DEFAULT_VARIANTS = {
    "gspo": "configs/tiny_moe_cpu.yaml",
    "grpo": "configs/tiny_moe_cpu_grpo.yaml",
    "grpo_r2": "configs/tiny_moe_cpu_grpo.yaml,algorithm.routing_replay=r2",
}
SUMMARY_KEYS = {
    "actor/clipfrac_tokens": "clipped tokens",
    "actor/clipfrac_seq": "clipped sequences",
    "drift/old_new/mean": "old->new drift",
    "time/step_s": "step s",
}


def parse_variant(text: str) -> tuple[str, str, list[str]]:
    name, _, spec = text.partition("=")
    config, *overrides = spec.split(",")
    return name, config, overrides


def run_one(name: str, config: str, overrides: list[str], seed: int, out: Path, steps: int | None) -> Path:
    run_dir = out / name / f"seed{seed}"
    extra = [f"trainer.steps={steps}"] if steps else []
    cmd = [
        sys.executable, "-m", "megatron_gspo.cli", "train", "--config", config,
        f"trainer.seed={seed}", f"sft.seed={seed}", f"trainer.run_dir={run_dir}", "drift.enabled=true",
        "logging.progress_bar=false", *overrides, *extra,
    ]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "harness.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    return run_dir / "metrics.jsonl"


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(records: dict[str, dict[int, list[dict]]]) -> dict:
    summary = {}
    for name, by_seed in records.items():
        evals = {
            seed: [(r["step"], r["eval/accuracy"]) for r in rs if "eval/accuracy" in r]
            for seed, rs in by_seed.items()
        }
        row = {
            "cold_start": statistics.mean(e[0][1] for e in evals.values()),
            "final": statistics.mean(e[-1][1] for e in evals.values()),
            "per_seed": {seed: (e[0][1], e[-1][1]) for seed, e in evals.items()},
            "curve": _mean_curve(evals),
        }
        for key in SUMMARY_KEYS:
            values = [r[key] for rs in by_seed.values() for r in rs if key in r]
            row[key] = statistics.mean(values) if values else None
        summary[name] = row
    return summary


def _mean_curve(evals: dict[int, list[tuple[int, float]]]) -> list[tuple[int, float]]:
    steps = sorted({step for e in evals.values() for step, _ in e})
    curve = []
    for step in steps:
        values = [acc for e in evals.values() for s, acc in e if s == step]
        curve.append((step, statistics.mean(values)))
    return curve


def write_report(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    header = "| variant | cold start | final | " + " | ".join(SUMMARY_KEYS.values()) + " |"
    lines = [header, "|" + "---|" * (3 + len(SUMMARY_KEYS))]
    for name, row in summary.items():
        cells = [f"{row[k]:.4g}" if row[k] is not None else "-" for k in SUMMARY_KEYS]
        lines.append(f"| {name} | {row['cold_start']:.3f} | {row['final']:.3f} | " + " | ".join(cells) + " |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in summary.items():
        steps, accs = zip(*row["curve"])
        ax.plot(steps, accs, marker="o", label=name)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out accuracy (mean over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=120)
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--variant", action="append", help="name=config.yaml[,key=value...] (repeatable)")
    parser.add_argument("--steps", type=int, default=None, help="override trainer.steps")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (each uses ~2 processes)")
    parser.add_argument("--out", type=Path, default=Path("runs/gspo_vs_grpo"))
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant] if args.variant else [
        parse_variant(f"{k}={v}") for k, v in DEFAULT_VARIANTS.items()
    ]  # fmt: skip
    jobs = [(name, config, overrides, seed) for name, config, overrides in variants for seed in args.seeds]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        paths = list(pool.map(lambda j: run_one(*j, args.out, args.steps), jobs))
    records: dict[str, dict[int, list[dict]]] = {}
    for (name, _, _, seed), path in zip(jobs, paths):
        records.setdefault(name, {})[seed] = read_metrics(path)
    write_report(summarise(records), args.out)


if __name__ == "__main__":
    main()
