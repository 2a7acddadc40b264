"""Every benchmark ratio measured in one run, side by side with its goal.

    OMP_NUM_THREADS=1 python benchmarks/run.py [--quick] [--out DIR]

Writes `<out>/RESULTS.md` (the table, the machine it ran on) and `<out>/results/results.json`
(the same rows plus every figure each benchmark returned); `<out>` is `benchmarks/` (the
committed results) or, with `--quick`, `benchmarks/quick/`, which git ignores. Each ratio compares two things
measured in this run, interleaved where timed: these machines are noisy, and a ratio from one
run says more than two timings from two. `--quick` (under a minute here) shrinks every
benchmark for a smoke test; its figures are not the ones to quote.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the bench_* modules sit next to this file

# Each benchmark module exposes `measure(quick: bool) -> dict`.
BENCHES = {
    "train_step": "bench_train_step",
    "moe_experts": "bench_moe_experts",
    "logprobs": "bench_logprobs",
    "micro_batching": "bench_micro_batching",
    "server_throughput": "bench_server_throughput",
    "weight_sync": "bench_weight_sync",
    "validation": "bench_validation",
    "async": "bench_async",
}


@dataclass(frozen=True)
class Row:
    """One line of the table: a figure from one benchmark, its goal (`op` None: none) and what lies behind it.

    `detail` is formatted with the benchmark's result dict (e.g. "{rl_ms:.1f} ms").
    """

    name: str
    bench: str
    key: str
    op: str | None = None
    goal: float | None = None
    detail: str = ""
    percent: bool = False

    def met(self, value: float) -> bool | None:
        if self.op is None:
            return None
        return value <= self.goal if self.op == "<=" else value >= self.goal

    def fmt(self, value: float) -> str:
        return f"{value:.1%}" if self.percent else f"{value:.3f}"


STEP = "{rows:.0f} rows, median ms and paired ratio of {repeats:.0f} repeats"
MINIS = "{mini_batches:.0f} mini-batches, "
ROWS = [
    Row("RL train step / plain Megatron LM (cross-entropy) step, same packed tokens", "train_step",
        "rl_vs_lm", "<=", 1.10, "GSPO {rl_ms:.1f} ms vs LM {lm_ms:.1f} ms; " + MINIS + STEP),
    Row("step with rollout log-probs / step recomputing pi_old, 1 mini-batch", "train_step",
        "rollout_vs_recompute_1mb", "<=", 0.75,
        "{rollout_1mb_ms:.1f} ms vs {recompute_1mb_ms:.1f} ms; " + STEP),
    Row("step with rollout log-probs / step recomputing pi_old, 4 mini-batches (demo)", "train_step",
        "rollout_vs_recompute", "<=", 0.75, "{rl_ms:.1f} ms vs {recompute_ms:.1f} ms; " + STEP),
    Row("GRPO+R2 step / GRPO step, without the recording pass", "train_step", "r2_vs_grpo", "<=", 1.05,
        "{grpo_r2_ms:.1f} ms vs {grpo_ms:.1f} ms; " + MINIS + STEP),
    Row("GRPO+R2 step / GRPO step, with the recording pass", "train_step", "r2_record_vs_grpo", None, None,
        "{grpo_r2_record_ms:.1f} ms vs {grpo_again_ms:.1f} ms; " + MINIS + STEP),
    Row("local experts forward+backward: grouped_local_experts / megatron's loop, demo layer",
        "moe_experts", "demo_grouped_vs_loop", None, None,
        "{demo_grouped_ms:.2f} ms vs {demo_loop_ms:.2f} ms; 8 experts top-2, {tokens:.0f} tokens"),
    Row("local experts forward+backward: grouped_local_experts / megatron's loop, drift layer",
        "moe_experts", "drift_grouped_vs_loop", None, None,
        "{drift_grouped_ms:.2f} ms vs {drift_loop_ms:.2f} ms; 32 experts top-4"),
    Row("log-prob peak extra memory / logits size, fp32 (forward)", "logprobs", "ours_fp32_forward",
        "<=", 0.25, "megatron's CE: {megatron_fp32_forward:.2f}, naive: {naive_fp32_forward:.2f}; "
        "logits [{seq:.0f}, {batch:.0f}, {vocab:.0f}]"),
    Row("log-prob peak extra memory / logits size, bf16 (forward)", "logprobs", "ours_bf16_forward",
        "<=", 0.25, "megatron's CE (an fp32 copy): {megatron_bf16_forward:.2f}, "
        "naive: {naive_bf16_forward:.2f}"),
    Row("log-prob peak extra memory / logits size, fp32 (forward+backward)", "logprobs",
        "ours_fp32_forward_backward", None, None,
        "megatron's CE: {megatron_fp32_forward_backward:.2f}, naive: {naive_fp32_forward_backward:.2f}"),
    Row("log-prob peak extra memory / logits size, bf16 (forward+backward)", "logprobs",
        "ours_bf16_forward_backward", None, None,
        "megatron's CE: {megatron_bf16_forward_backward:.2f}, naive: {naive_bf16_forward_backward:.2f}"),
    Row("padding waste of packed micro-batches, demo config", "micro_batching", "demo_padding", "<=", 0.05,
        "answers + EOS as responses, whole mini-batch per micro-batch", percent=True),
    Row("padding waste, reasoning-shaped step (DP 8), token-budget cut", "micro_batching",
        "reasoning_padding_by_tokens", "<=", 0.05,
        "{reasoning_rows:.0f} rows; by count (4 rows): {reasoning_padding_by_count:.1%}", percent=True),
    Row("embedded server completion tokens/s / transformers generate", "server_throughput",
        "server_vs_generate", ">=", 0.5, "{server_tokens_per_s:.0f} vs {generate_tokens_per_s:.0f} tokens/s; "
        "{batch:.0f} prompts x {new_tokens:.0f} tokens, 1 thread each"),
    Row("weight sync: sending-rank peak extra memory / bucket size", "weight_sync", "memory_over_bucket",
        "<=", 2.5, "{parameters:.3g} parameters, {bucket_mb:g} MiB buckets"),
    Row("weight sync: time distributed / disk", "weight_sync", "time_distributed_over_disk", "<=", 0.5,
        "{methods[distributed][seconds]:.2f} s vs {methods[disk][seconds]:.2f} s"),
    Row("rollout validation: time after / before vectorising", "validation", "after_vs_before", None, None,
        "{tokens:.0f} tokens with routed experts 48x8"),
    Row("rollout validation: ms per million tokens (routed experts 48x8)", "validation",
        "after_ms_per_m_tokens", None, None, "before: {before_ms_per_m_tokens:.0f} ms"),
    Row("RL steps/s, rollout.max_staleness 1 / 0, demo config", "async", "k1_vs_k0", ">=", 1.3,
        "{k1_steps_per_s:.1f} vs {k0_steps_per_s:.1f} steps/s, overlap {k1_overlap:.0%}; bound {bound:.2f} "
        "(rollout {rollout_ms:.0f} ms, train {train_ms:.0f} ms, sync {sync_ms:.0f} ms); "
        "median of {repeats:.0f} interleaved runs of {steps:.0f} steps"),
    Row("RL steps/s, rollout.max_staleness 2 / 0, demo config", "async", "k2_vs_k0", None, None,
        "{k2_steps_per_s:.1f} steps/s, overlap {k2_overlap:.0%}"),
]  # fmt: skip


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, str | int]:
    """What the figures were measured on."""
    import torch

    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True
    ).stdout.strip()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count() or 0,
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron-core": _version("megatron-core"),
        "transformers": _version("transformers"),
        "os": platform.platform(),
        "commit": commit or "unknown",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_1min_at_start": f"{os.getloadavg()[0]:.1f}",  # other work sharing the cores
    }


def run_all(quick: bool) -> tuple[dict[str, dict], dict[str, float]]:
    """Every benchmark's figures and its wall time in seconds."""
    results, seconds = {}, {}
    for name, module in BENCHES.items():
        start = time.perf_counter()
        print(f"[run] {name} ...", flush=True)
        results[name] = importlib.import_module(module).measure(quick)
        seconds[name] = time.perf_counter() - start
        print(f"[run] {name}: {seconds[name]:.1f} s", flush=True)
    return results, seconds


def table(results: dict[str, dict]) -> tuple[list[dict], str]:
    """The rows as records and as a markdown table."""
    records, lines = [], ["| figure | measured | goal | met | behind it |", "|---|---:|---:|:---:|---|"]
    for row in ROWS:
        value = float(results[row.bench][row.key])
        met = row.met(value)
        goal = f"{row.op} {row.fmt(row.goal)}" if row.op else "-"
        detail = row.detail.format(**results[row.bench])
        records.append({"name": row.name, "bench": row.bench, "key": row.key, "value": value,
                        "goal": None if row.op is None else f"{row.op} {row.goal}", "met": met,
                        "detail": detail})  # fmt: skip
        mark = {True: "yes", False: "**no**", None: "-"}[met]
        lines.append(f"| {row.name} | {row.fmt(value)} | {goal} | {mark} | {detail} |")
    return records, "\n".join(lines)


def write(out: Path, quick: bool, info: dict, results: dict, seconds: dict) -> Path:
    records, markdown = table(results)
    (out / "results").mkdir(parents=True, exist_ok=True)
    payload = {"quick": quick, "machine": info, "rows": records, "seconds": seconds, "benchmarks": results}
    (out / "results" / "results.json").write_text(json.dumps(payload, indent=2, default=float) + "\n")
    machine_lines = "\n".join(f"- {k}: {v}" for k, v in info.items())
    load = max(float(info["load_average_1min_at_start"]), float(info["load_average_1min_at_end"]))
    shared = (
        f"**The machine was shared** (load average up to {load:.0f} on {info['cores']} cores): the ratios "
        "pair measurements taken together, but single-sample figures (weight sync) are noisy.\n\n"
        if load > info["cores"]
        else ""
    )
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
    report = out / "RESULTS.md"
    report.write_text(
        f"# Benchmark results{' (quick mode: smoke-test sizes, not figures to quote)' if quick else ''}\n\n"
        "Written by `python benchmarks/run.py`; every ratio is measured within this one run "
        "(see each `benchmarks/bench_*.py` for what exactly is compared). Raw figures: "
        "`results/results.json`.\n\n"
        f"{shared}{markdown}\n\n## Machine\n\n{machine_lines}\n\nWall time per benchmark: {timing}.\n"
    )
    return report


def output_dir(out: Path | None, quick: bool) -> Path:
    """`out`, else benchmarks/ for a full run and the git-ignored benchmarks/quick/ for --quick."""
    if out is not None:
        return out
    return HERE / "quick" if quick else HERE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute (smoke test)")
    parser.add_argument(
        "--out", type=Path, default=None,
        help="where RESULTS.md and results/ go (default: benchmarks/; with --quick benchmarks/quick/, "
        "so a smoke test never overwrites the committed results)",
    )  # fmt: skip
    args = parser.parse_args()
    args.out = output_dir(args.out, args.quick)
    info = machine()
    results, seconds = run_all(args.quick)
    info["load_average_1min_at_end"] = f"{os.getloadavg()[0]:.1f}"
    report = write(args.out, args.quick, info, results, seconds)
    print(report.read_text())


if __name__ == "__main__":
    main()
