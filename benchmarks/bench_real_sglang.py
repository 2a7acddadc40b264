"""Real SGLang 0.5.23 (CPU engine) vs the embedded server: rollout throughput, and a run's split.

    OMP_NUM_THREADS=1 python benchmarks/bench_real_sglang.py [--quick] [--runs]

Throughput: the demo's policy at its init (an HF checkpoint) served by both servers at once, one
torch thread each; the same batched `/generate` with log-probs (the demo's batch: 16 prompts x 8
samples, 4 tokens, temperature 0.7; and a longer one: 64 x 32 tokens, EOS ignored) sent to each
alternately. Reports tokens/s of each and the median per-repeat ratio sglang / embedded, so that
load from other work cancels out.

--runs also trains the demo config for a few RL steps with each engine, fp32 and bf16 rollouts,
drift on, and prints per run what the step metrics say: the trainer vs rollout log-prob mismatch,
how often the engines route a token to other experts (per layer), and the step's time split.
Needs launch/setup_sglang.sh's environment.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server_throughput import alternate, demo_prompts, export_demo_model, server_call  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"demo batch (128 x 4 tokens)": (16, 8, 4), "long (64 x 32 tokens)": (64, 1, 32)}


def throughput(quick: bool) -> dict[str, dict[str, float]]:
    """Per shape: tokens/s of each server and the median ratio sglang / embedded."""
    from megatron_gspo.rollout.client import SGLangClient
    from megatron_gspo.rollout.server.launch import launch_embedded_server
    from megatron_gspo.rollout.sglang_launch import launch_sglang_server

    repeats = 2 if quick else 7
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp, "policy")
        cfg, tokenizer = export_demo_model(model_dir)
        with (
            launch_embedded_server(model_dir, num_threads=1) as embedded,
            launch_sglang_server(
                model_dir, log_path=Path(tmp, "sglang.log"), extra_args=["--skip-server-warmup"]
            ) as real,
            SGLangClient([embedded.url]) as to_embedded,
            SGLangClient([real.url]) as to_sglang,
        ):
            for shape, (prompts, samples, new_tokens) in SHAPES.items():
                batch = [p for p in demo_prompts(cfg, tokenizer, prompts) for _ in range(samples)]
                calls = {
                    "embedded": server_call(to_embedded, batch, new_tokens, cfg.rollout.temperature),
                    "sglang": server_call(to_sglang, batch, new_tokens, cfg.rollout.temperature),
                }
                rates = alternate(calls, repeats)
                out[shape] = {
                    "embedded_tokens_per_s": statistics.median(rates["embedded"]),
                    "sglang_tokens_per_s": statistics.median(rates["sglang"]),
                    "sglang_vs_embedded": statistics.median(
                        s / e for s, e in zip(rates["sglang"], rates["embedded"])
                    ),
                }
    return out


RUN_METRICS = (
    "rollout/logprob_mismatch_mean",
    "rollout/logprob_mismatch_max",
    "drift/infer_train/layer_0",
    "drift/infer_train/layer_1",
    "drift/infer_train/tokens_changed",
    "time/rollout_s",
    "time/sync_s",
    "time/train_s",
    "time/step_s",
)


def train_runs(steps: int) -> dict[str, dict[str, float]]:
    """Per (engine, rollout dtype): each metric's mean over the run's RL steps."""
    from megatron_gspo.training.metrics import read_metrics

    out = {}
    for engine in ("embedded", "sglang"):
        for dtype in ("fp32", "bf16"):
            with tempfile.TemporaryDirectory() as run_dir:
                cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", "--config",
                       str(REPO / "configs" / "tiny_moe_cpu.yaml"), f"rollout.engine={engine}",
                       f"rollout.dtype={dtype}", f"trainer.steps={steps}", "sft.steps=30", "eval.every=0",
                       "drift.enabled=true", "logging.progress_bar=false",
                       f"trainer.run_dir={run_dir}"]  # fmt: skip
                done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                                      text=True, check=False)  # fmt: skip
                if done.returncode != 0:
                    raise RuntimeError(f"{engine} {dtype} run failed:\n{done.stderr[-3000:]}")
                records = [r for r in read_metrics(Path(run_dir, "metrics.jsonl")) if r["step"] > 0]
                out[f"{engine} {dtype}"] = {
                    key: statistics.mean(r[key] for r in records if key in r)
                    for key in RUN_METRICS
                    if any(key in r for r in records)
                }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats instead of 7; 3-step runs")
    parser.add_argument("--runs", action="store_true", help="also the engine x dtype training runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"throughput": throughput(args.quick)}
    if args.runs:
        result["runs"] = train_runs(3 if args.quick else 10)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
