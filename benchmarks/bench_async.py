"""RL steps per second with rollouts ahead of training: rollout.max_staleness 0 / 1 / 2 on the demo config.

    OMP_NUM_THREADS=1 python benchmarks/bench_async.py [--quick] [--repeats 2] [--steps 30]

Each variant is a real `megatron-gspo train` of `configs/tiny_moe_cpu.yaml` from the same cold
start (same seed, same short SFT), run as its own process; the variants are interleaved
(k = 0, 1, 2, then again) so load on the machine hits them alike. Steps per second come
from the steps' own `time/step_s` (the first step, a warm-up, and the last, which saves a
checkpoint, left out). Reported: each k's steps/s, its ratio to k = 0 (median over repeats),
the mean `perf/overlap`, and the bound staleness can reach on this machine, from the k = 0
run's phases: (rollout + train + sync) / max(train + sync, rollout), since at best the
rollout hides entirely behind training and sync.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STALENESS = (0, 1, 2)


def _run(k: int, steps: int, sft_steps: int, run_dir: Path) -> list[dict]:
    """One training run at staleness `k`; its per-step metric records."""
    cmd = [
        sys.executable, "-m", "megatron_gspo.cli", "train",
        "--config", str(REPO / "configs" / "tiny_moe_cpu.yaml"),
        f"trainer.steps={steps}", f"sft.steps={sft_steps}", "sft.target_accuracy=null", "eval.every=0",
        "eval.at_start=false", "eval.at_end=false", "trainer.save_every=0", "logging.progress_bar=false",
        f"trainer.run_dir={run_dir}", f"rollout.max_staleness={k}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=run_dir.parent, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"staleness {k}: train failed:\n{done.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("step", 0) >= 1]


def _steps_per_s(records: list[dict]) -> float:
    timed = records[1:-1]  # no warm-up step, no checkpointing last step
    return len(timed) / sum(r["time/step_s"] for r in timed)


def measure(quick: bool, repeats: int | None = None, steps: int | None = None) -> dict:
    """Steps/s per staleness, ratios to k = 0, overlap and the bound (see the module docstring)."""
    repeats = repeats or (1 if quick else 2)
    steps = steps or (4 if quick else 30)
    sft_steps = 0 if quick else 30  # quick: a smoke test, from the random init
    rates: dict[int, list[float]] = {k: [] for k in STALENESS}
    overlap: dict[int, list[float]] = {k: [] for k in STALENESS}
    phases: list[tuple[float, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for rep in range(repeats):
            for k in STALENESS:
                records = _run(k, steps, sft_steps, Path(tmp) / f"k{k}_r{rep}")
                rates[k].append(_steps_per_s(records))
                overlap[k].append(statistics.fmean(r.get("perf/overlap", 0.0) for r in records[1:-1]))
                if k == 0:
                    timed = records[1:-1]
                    phases.append(
                        tuple(
                            statistics.fmean(r[f"time/{p}_s"] for r in timed)
                            for p in ("rollout", "train", "sync")
                        )
                    )
    rollout, train, sync = (statistics.fmean(p[i] for p in phases) for i in range(3))
    bound = (rollout + train + sync) / max(train + sync, rollout)
    out: dict = {"repeats": repeats, "steps": steps, "rollout_ms": 1e3 * rollout, "train_ms": 1e3 * train,
                 "sync_ms": 1e3 * sync, "bound": bound}  # fmt: skip
    for k in STALENESS:
        out[f"k{k}_steps_per_s"] = statistics.median(rates[k])
        out[f"k{k}_overlap"] = statistics.fmean(overlap[k])
        out[f"k{k}_vs_k0"] = statistics.median(r / r0 for r, r0 in zip(rates[k], rates[0]))
    return out


def main() -> None:
    """Print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    print(json.dumps(measure(args.quick, args.repeats, args.steps), indent=2))


if __name__ == "__main__":
    main()
