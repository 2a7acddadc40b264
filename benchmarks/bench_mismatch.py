"""Train/inference mismatch with a bf16 rollout server, and whether GSPO on rollout log-probs learns.

    python benchmarks/bench_mismatch.py --out runs/bench_mismatch [--quick] [--jobs 2]

Each variant is one `megatron-gspo train` run (drift metrics on, `rollout.dtype: bf16`); the
harness reads every run's metrics.jsonl and writes `summary.md` / `summary.json`, one row per
variant: the token log-prob mismatch between the server and the trainer on the rollout weights
(`rollout/logprob_mismatch_mean`, `rollout/k3_kl`), inference->training routing drift (fraction
of top-k choices that differ, `drift/infer_train/mean`), GSPO's clipped-sequence fraction of the
first mini-batch (`actor/clipfrac_seq_first_mb`: before any update, so with
`old_logprobs: rollout` it is mismatch alone; with `recompute` it is 0), old->new drift after one
update (`drift/old_new_mb1/mean`) and over mini-batches 1..M-1, the mean training reward and the
held-out accuracy at the start and the end. Metrics are means over the run's steps.

Default variants: the tiny demo (configs/tiny_moe_cpu.yaml, 150 steps) and the deeper MoE
(configs/drift_moe_cpu.yaml at lr 3e-4, 30 steps), each with pi_old from the rollout server
(`rollout`) and from a trainer recompute (`recompute`), plus a bf16 trainer on the tiny model.
`--quick` runs 10 steps of each (mismatch numbers only; too short to compare learning).
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

TINY = "configs/tiny_moe_cpu.yaml"
DEEP = "configs/drift_moe_cpu.yaml"
DEEP_LEARN = ["optim.lr=3e-4", "optim.lr_warmup_steps=8", "eval.every=10", "trainer.steps=30"]
DEFAULT_VARIANTS = {
    "tiny fp32 trainer, rollout": (TINY, ["algorithm.old_logprobs=rollout"]),
    "tiny fp32 trainer, recompute": (TINY, ["algorithm.old_logprobs=recompute"]),
    "tiny bf16 trainer, rollout": (TINY, ["algorithm.old_logprobs=rollout", "engine.dtype=bf16"]),
    "deep fp32 trainer, rollout": (DEEP, [*DEEP_LEARN, "algorithm.old_logprobs=rollout"]),
    "deep fp32 trainer, recompute": (DEEP, [*DEEP_LEARN, "algorithm.old_logprobs=recompute"]),
}
MEAN_KEYS = {
    "rollout/logprob_mismatch_mean": "mean abs lp diff",
    "rollout/k3_kl": "k3 KL",
    "drift/infer_train/mean": "infer->train drift",
    "actor/clipfrac_seq_first_mb": "clipfrac seq first mb",
    "drift/old_new_mb1/mean": "old->new drift, 1 update",
    "drift/old_new/mean": "old->new drift, mb 1..M-1",
    "rewards/mean": "train reward",
}


def run_one(name: str, config: str, overrides: list[str], seed: int, out: Path, steps: int | None) -> Path:
    run_dir = out / name.replace(" ", "_").replace(",", "")
    extra = [f"trainer.steps={steps}", "eval.every=0"] if steps else []
    cmd = [
        sys.executable, "-m", "megatron_gspo.cli", "train", "--config", config,
        f"trainer.seed={seed}", f"trainer.run_dir={run_dir}", "drift.enabled=true",
        "rollout.dtype=bf16", "logging.progress_bar=false", *overrides, *extra,
    ]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "harness.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    return run_dir / "metrics.jsonl"


def summarise(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    out: dict = {"steps": max(r["step"] for r in rows), "start": evals[0][1], "end": evals[-1][1]}
    for key in MEAN_KEYS:
        values = [r[key] for r in rows if key in r]
        out[key] = statistics.mean(values) if values else None
    return out


def write_report(summary: dict[str, dict], out: Path) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    head = "| variant | steps | " + " | ".join(MEAN_KEYS.values()) + " | held-out start -> end |"
    lines = [head, "|" + "---|" * (3 + len(MEAN_KEYS))]
    for name, row in summary.items():
        cells = [f"{row[k]:.3g}" if row[k] is not None else "-" for k in MEAN_KEYS]
        lines.append(
            f"| {name} | {row['steps']} | "
            + " | ".join(cells)
            + f" | {row['start']:.3f} -> {row['end']:.3f} |"
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="10 RL steps per variant (mismatch only)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (each uses ~2 processes)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_mismatch"))
    args = parser.parse_args()
    steps = 10 if args.quick else None
    jobs = list(DEFAULT_VARIANTS.items())
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        paths = list(pool.map(lambda j: run_one(j[0], *j[1], args.seed, args.out, steps), jobs))
    write_report({name: summarise(path) for (name, _), path in zip(jobs, paths)}, args.out)


if __name__ == "__main__":
    main()
