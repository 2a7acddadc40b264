"""GSPO without Routing Replay vs GRPO with and without it, on a tiny MoE whose routing drifts.

    OMP_NUM_THREADS=1 python benchmarks/reproduce.py --seeds 1 2 3 --jobs 2 \\
        [--variants gspo grpo ...] [--set optim.lr=5e-4 --set trainer.steps=30] [--target-gain 0.1]
    python benchmarks/reproduce.py --quick --out /tmp/q --work-dir /tmp/q/runs    # smoke test
    python benchmarks/reproduce.py --grid --jobs 1 [--updates 1 4 8 16] [--seeds 1 2 3 4 5]
    python benchmarks/reproduce.py --staleness 0 2 4 [--variants gspo grpo grpo_r2 grpo_r3] [--set ...]

The GSPO paper's claim (arXiv 2507.18071): on MoE models GRPO needs Routing Replay to stay stable
when the experts a token is routed to change between pi_old and pi_theta, and GSPO does not.
Every variant is the base config `configs/drift_moe_cpu.yaml` (8 layers, 32 experts top-4, digit
sorting, bf16 rollouts, drift metrics on) with the overrides of `VARIANTS`, then `--set`:

- gspo (no replay), grpo (no replay), grpo_r2, grpo_r3 (GRPO's clip 0.2 / 0.27), sapo (its
  default soft gate, tau 1.0 / 1.05), gspo_r3 (control: GSPO with replay).

Same cold start per seed: one `megatron-gspo train` of the base config with `trainer.steps=0`
runs the config's SFT (sft.seed = trainer.seed = seed) and evaluates it; the trainer exports
those weights as an HF checkpoint to start its rollout server (`trainer.weight_sync_dir`), and
that checkpoint is where every variant of the seed starts RL (`model.hf_path`, `sft.steps=0`,
the same seed, hence the same prompts and rollout budget). The report checks that all of them
logged the cold start's held-out accuracy at step 0.

`--jobs N` runs N trainings at once, each one process (world 1) plus its embedded rollout
server, with OMP_NUM_THREADS=1. Run directories (metrics, logs, the trainer's final checkpoint)
go under `--work-dir`, named by seed and a hash of their config, so a finished run (`done.json`,
written after a successful exit) is reused by any later invocation with the same config, and
an unfinished one is deleted and restarted. A failed run is reported with its log and does not
stop the others (exit status 1 at the end). `--out` gets only summary.md, summary.json and
reproduce.png (see reproduce_report.py).

`--grid` runs the stability grid instead (stability_grid.py): FP8 rollouts and a bf16 trainer
for every run and cold start, each of its variants at N optimizer steps per rollout batch
(`--updates`), plus cells at rollout.max_staleness=2 (`--stale-variants`, `--stale-updates`) and
bf16-rollout reference cells at N=1 (`--reference-variants`);
each cell is one "variant" to the harness above, and `--out` (default
benchmarks/results/stability_grid) gets summary.md, summary.json and stability_grid.png.

`--staleness K ...` runs the staleness sweep instead (staleness_sweep.py): each variant (default
gspo, grpo, grpo_r2, grpo_r3) at rollout.max_staleness = each K (default 0 2 4), update mode
drain, from the same cold starts; `--out` (default benchmarks/results/reproduce_staleness) gets
summary.md, summary.json and staleness_sweep.png, with behaviour -> current routing drift per K.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from megatron_gspo.python_command import python_command

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))  # reproduce_report and run (machine description) sit next to this file

import stability_grid  # noqa: E402
import staleness_sweep  # noqa: E402
from reproduce_report import ColdStart, Run, assemble, markdown, plot, read_metrics  # noqa: E402

BASE_CONFIG = REPO / "configs" / "drift_moe_cpu.yaml"
GRPO_CLIP = {"algorithm.loss_type": "grpo", "algorithm.loss_options": {"clip_low": 0.2, "clip_high": 0.27}}
# name -> overrides of the base config; a value replaces the key whole (loss_options included).
VARIANTS: dict[str, dict[str, Any]] = {
    "gspo": {},  # the base config: sequence ratio, clip 3e-4 / 4e-4, no replay
    "grpo": GRPO_CLIP,
    "grpo_r2": {**GRPO_CLIP, "algorithm.routing_replay": "r2"},
    "grpo_r3": {**GRPO_CLIP, "algorithm.routing_replay": "r3"},
    "sapo": {"algorithm.loss_type": "sapo", "algorithm.loss_options": {}},
    "gspo_r3": {"algorithm.routing_replay": "r3"},
}
# Every run: drift metrics (the point of the comparison), no TensorBoard or progress bar, only
# the trainer's final checkpoint.
HARNESS = {
    "drift.enabled": True,
    "logging.tensorboard": False,
    "logging.progress_bar": False,
    "trainer.save_every": 0,
    "trainer.keep_last": 1,
}
# Set per run here: a --set of these would break the shared cold start or make parallel runs collide.
RESERVED = (
    "trainer.seed",
    "sft.seed",
    "trainer.run_dir",
    "trainer.weight_sync_dir",
    "model.hf_path",
    "trainer.resume",
    "trainer.resume_or_start",
)
# What the cold start depends on: its directory is keyed by these, so an RL-only --set reuses it.
COLD_START_KEYS = ("model", "task", "sft", "engine", "parallel", "rollout.dtype", "rollout.quantization",
                   "rollout.max_new_tokens", "eval.num_problems", "trainer.seed")  # fmt: skip
# --quick: a 2-layer model sorting 1-3 digits, 60 SFT steps, 3 RL steps of 4 prompts x 4 responses.
QUICK = {
    "task.options": {"min_length": 1, "max_length": 3},
    "rollout.max_new_tokens": 4,
    "model.overrides.num_layers": 2,
    "model.overrides.num_experts": 8,
    "model.overrides.moe_topk": 2,
    "sft.steps": 60,
    "trainer.steps": 3,
    "rollout.rollout_batch_size": 4,
    "rollout.group_size": 4,
    "eval.every": 1,
    "eval.num_problems": 20,
}
QUICK_VARIANTS, QUICK_SEEDS = ["gspo", "grpo_r3"], [1]
DONE = "done.json"
NOT_RUN = "not run (--report-only)"


@dataclass(eq=False)
class Job:
    """One `megatron-gspo train`: a cold start (variant None) or a variant's RL run."""

    variant: str | None
    seed: int
    run_dir: Path
    config: DictConfig
    needs: Job | None = None
    product: Path | None = None
    """A file the run must leave behind to count as finished (the cold start's HF export)."""

    @property
    def label(self) -> str:
        return f"{self.variant or 'cold start'} seed {self.seed}"


@dataclass
class Outcome:
    """How a job ended: finished now, reused (finished earlier) or failed."""

    status: str
    seconds: float = 0.0
    message: str = ""


def parse_set(items: list[str]) -> dict[str, Any]:
    """`key=value` strings -> {key: value} (values parsed as YAML); refuses reserved keys."""
    out = {}
    for item in items:
        key, sep, _ = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected section.key=value, e.g. optim.lr=5e-4")
        if key in RESERVED:
            raise ValueError(f"--set {key}: set by the harness for every run; choose runs with --seeds")
        flat = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
        for part in key.split("."):
            flat = flat[part]
        out[key] = flat
    return out


def compose(*layers: dict[str, Any]) -> DictConfig:
    """The base config with each layer's `key: value` set in order (a value replaces the key whole)."""
    cfg = OmegaConf.load(BASE_CONFIG)
    for layer in layers:
        for key, value in layer.items():
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    return cfg


def config_hash(cfg: DictConfig, keys: tuple[str, ...] | None = None) -> str:
    """A short hash of the config (or of `keys` of it), independent of key order."""
    if keys is None:
        data = OmegaConf.to_container(cfg)
    else:
        picked = {key: OmegaConf.select(cfg, key) for key in keys}
        data = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in picked.items()}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]


def check_config(name: str, cfg: DictConfig) -> None:
    """Load and validate a variant's config as the trainer will, so bad input fails before any run."""
    from megatron_gspo.config import ConfigError, load_config, validate

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(OmegaConf.to_yaml(cfg))
        f.flush()
        try:
            validate(load_config(f.name), world_size=1)
        except ConfigError as err:
            raise ValueError(f"variant {name}: config error: {err}") from None


def plan(
    variants: list[str],
    seeds: list[int],
    sets: dict[str, Any],
    work: Path,
    specs: dict[str, dict[str, Any]] = VARIANTS,
    defaults: dict[str, Any] | None = None,
) -> list[Job]:
    """Cold starts first, then each seed's variants (each needing its seed's cold start).

    A run's config: the base config, `HARNESS`, the sweep's `defaults` (the grid's FP8 rollouts
    and bf16 trainer), the variant's overrides (`specs[name]`; the grid's cells are variants too),
    `sets` (--set wins), then what the harness sets per run (seeds, directories, the cold start's
    checkpoint). Cold starts take `defaults` and `sets`.
    """
    base = {**HARNESS, **(defaults or {})}
    for name in variants:
        check_config(name, compose(base, specs[name], sets))
    # RL starts from the cold start's weights: no SFT (nor its early-stop target, which needs SFT steps).
    no_sft = {"sft.steps": 0, "sft.target_accuracy": None}
    jobs, runs = [], []
    for seed in seeds:
        seeded = {"trainer.seed": seed, "sft.seed": seed}
        cold_key = config_hash(compose(base, sets, seeded), COLD_START_KEYS)
        cold_dir = work / "cold_start" / f"seed{seed}-{cold_key}"
        where = {"trainer.run_dir": str(cold_dir), "trainer.weight_sync_dir": str(cold_dir / "hf")}
        cold_cfg = compose(base, sets, seeded, {"trainer.steps": 0, **where})
        cold = Job(None, seed, cold_dir, cold_cfg, product=cold_dir / "hf" / "config.json")
        jobs.append(cold)
        for name in variants:
            rl = compose(base, specs[name], sets, seeded, no_sft)
            rl.model.pop("overrides", None)  # the architecture comes from the cold start's checkpoint
            run_dir = work / name / f"seed{seed}-{config_hash(rl)}-{cold_key}"
            OmegaConf.update(rl, "model.hf_path", str(cold_dir / "hf"), force_add=True)
            OmegaConf.update(rl, "trainer.run_dir", str(run_dir), force_add=True)
            runs.append(Job(name, seed, run_dir, rl, needs=cold))
    return jobs + runs


def execute(job: Job, env: dict[str, str]) -> Outcome:
    """Run one job unless it finished before; an unfinished run dir is removed first."""
    if (job.run_dir / DONE).is_file():
        return Outcome("reused")
    if job.run_dir.exists():
        shutil.rmtree(job.run_dir)
    job.run_dir.mkdir(parents=True)
    config = job.run_dir / "input.yaml"
    config.write_text(OmegaConf.to_yaml(job.config))
    cmd = [*python_command(), "-m", "megatron_gspo.cli", "train", "--config", str(config)]
    start = time.perf_counter()
    with open(job.run_dir / "train.log", "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    seconds = time.perf_counter() - start
    if code != 0:
        return Outcome("failed", seconds, f"exit status {code}")
    if job.product is not None and not job.product.is_file():
        return Outcome("failed", seconds, f"exited 0 but left no {job.product}")
    marker = {"seconds": seconds, "finished": datetime.datetime.now(datetime.UTC).isoformat(), "command": cmd}
    tmp = job.run_dir / (DONE + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1))
    os.replace(tmp, job.run_dir / DONE)  # the marker appears whole or not at all
    return Outcome("finished", seconds)


def run_jobs(jobs: list[Job], workers: int) -> dict[Job, Outcome]:
    """Run up to `workers` jobs at once, each as soon as the job it needs has finished."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    outcomes: dict[Job, Outcome] = {}
    pending, running = list(jobs), {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        while pending or running:
            for job in list(pending):
                if len(running) >= workers:
                    break
                if job.needs is not None and job.needs not in outcomes:
                    continue
                pending.remove(job)
                if job.needs is not None and outcomes[job.needs].status == "failed":
                    outcomes[job] = Outcome(
                        "failed", message=f"cold start failed ({job.needs.run_dir}/train.log)"
                    )
                    report_progress(job, outcomes[job], len(outcomes), len(jobs))
                    continue
                running[pool.submit(execute, job, env)] = job
            if not running:
                continue
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                job = running.pop(future)
                outcomes[job] = _result(future)
                report_progress(job, outcomes[job], len(outcomes), len(jobs))
    return outcomes


def _result(future: Future) -> Outcome:
    try:
        return future.result()
    except OSError as err:  # e.g. an unwritable work dir: this job fails, the others go on
        return Outcome("failed", message=f"{type(err).__name__}: {err}")


def report_progress(job: Job, outcome: Outcome, done: int, total: int) -> None:
    where = job.run_dir / "train.log"
    detail = {"finished": f"in {outcome.seconds:.0f} s", "reused": "(finished earlier)"}.get(
        outcome.status, f"FAILED: {outcome.message}, log {where}"
    )
    print(f"[{done}/{total}] {job.label}: {outcome.status} {detail}", flush=True)


def collect(jobs: list[Job], outcomes: dict[Job, Outcome]) -> tuple[list[Run], list[ColdStart]]:
    """The report's view of every job: metrics of the finished ones, status and log of all."""
    runs, colds = [], []
    for job in jobs:
        outcome = outcomes[job]
        ok = outcome.status != "failed"
        records = read_metrics(job.run_dir / "metrics.jsonl") if ok else []
        log = os.path.relpath(job.run_dir / "train.log", REPO)  # committed summaries: no machine's paths
        if job.variant is None:
            colds.append(ColdStart(job.seed, outcome.status, log, records))
        else:
            loss = OmegaConf.select(job.config, "algorithm.loss_type")
            runs.append(Run(job.variant, job.seed, loss, outcome.status, log, records, outcome.message))
    return runs, colds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants", nargs="+", default=None,
        help=f"default: all; of {list(VARIANTS)}, or with --grid of {list(stability_grid.GRID_VARIANTS)}",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 1 2 3 (--grid: 1..5)")
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
        help="override of every run, e.g. optim.lr=5e-4 (repeatable; a value replaces the key whole)",
    )  # fmt: skip
    parser.add_argument(
        "--jobs", type=int, default=2, help="trainings at once (each one process + its server)"
    )
    parser.add_argument(
        "--out", type=Path, default=None,
        help="report directory (default: benchmarks/results/reproduce or .../stability_grid; --quick: "
        "under benchmarks/quick/, which git ignores, so a smoke test never overwrites the committed report)",
    )  # fmt: skip
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "reproduce")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--target", type=float, default=None, help="absolute held-out accuracy target")
    target.add_argument("--target-gain", type=float, default=0.1, help="target = cold start + this (default)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 variants x 1 seed, tiny settings")
    parser.add_argument(
        "--report-only", action="store_true",
        help="run nothing: report the runs already finished (same arguments otherwise); the others are "
        f"listed as failed with '{NOT_RUN}', e.g. while the same invocation still runs the rest",
    )  # fmt: skip
    grid = parser.add_argument_group("stability grid (stability_grid.py)")
    grid.add_argument(
        "--grid", action="store_true",
        help="variants x N updates per rollout batch (+ stale cells), FP8 rollouts, bf16 trainer",
    )  # fmt: skip
    grid.add_argument("--updates", type=int, nargs="+", default=None, help="N values (default: 1 4 8 16)")
    grid.add_argument(
        "--stale-variants", nargs="*", default=None,
        help=f"variants run at rollout.max_staleness={stability_grid.STALENESS} (default: "
        f"{' '.join(stability_grid.STALE_VARIANTS)}; none: no stale cells)",
    )  # fmt: skip
    grid.add_argument(
        "--reference-variants",
        nargs="*",
        default=None,
        help=f"variants run at N=1 with bf16 rollouts, the mismatch without FP8 (default: "
        f"{' '.join(stability_grid.REFERENCE_VARIANTS)}; none: no reference cells; --quick: none)",
    )
    grid.add_argument(
        "--stale-updates", type=int, default=None,
        help=f"N of the stale cells (default {stability_grid.STALE_UPDATES})",
    )  # fmt: skip
    sweep = parser.add_argument_group("staleness sweep (staleness_sweep.py)")
    sweep.add_argument(
        "--staleness", type=int, nargs="*", default=None, metavar="K",
        help=f"run each variant at rollout.max_staleness = each K (no K: {staleness_sweep.STALENESS}); "
        f"default variants {staleness_sweep.VARIANTS}",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.staleness is not None and args.grid:
        parser.error("--staleness and --grid are two different sweeps: choose one")
    if any(k < 0 for k in args.staleness or []):
        parser.error(f"--staleness: K must be >= 0, got {args.staleness}")
    kind = "stability_grid" if args.grid else "reproduce" if args.staleness is None else "reproduce_staleness"
    if args.out is None:
        args.out = REPO / "benchmarks" / ("quick" if args.quick else "results") / kind
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    grid_only = (args.updates, args.stale_variants is not None, args.stale_updates, args.reference_variants)
    if not args.grid and any(grid_only):
        parser.error("--updates, --stale-variants, --stale-updates and --reference-variants belong to --grid")
    known = stability_grid.GRID_VARIANTS if args.grid else VARIANTS
    for name in (args.variants or []) + (args.stale_variants or []) + (args.reference_variants or []):
        if name not in known:
            parser.error(f"unknown variant {name!r}; choose from {list(known)}")
    if any(n < 1 for n in args.updates or []) or (args.stale_updates or 1) < 1:
        parser.error("--updates / --stale-updates: N must be >= 1")
    args.parser = parser
    return args


def grid_plan(args: argparse.Namespace) -> tuple[list[stability_grid.Cell], dict[str, dict[str, Any]]]:
    """The grid's cells (from the arguments, or --quick's few) and their overrides by cell name."""
    quick_n, quick_stale = stability_grid.QUICK_STALE
    variants = args.variants or (
        stability_grid.QUICK_VARIANTS if args.quick else list(stability_grid.GRID_VARIANTS)
    )
    updates = args.updates or (stability_grid.QUICK_UPDATES if args.quick else stability_grid.UPDATES)
    stale = args.stale_variants if args.stale_variants is not None else (
        quick_stale if args.quick else stability_grid.STALE_VARIANTS)  # fmt: skip
    stale_n = args.stale_updates or (quick_n if args.quick else stability_grid.STALE_UPDATES)
    references = args.reference_variants if args.reference_variants is not None else (
        [] if args.quick else stability_grid.REFERENCE_VARIANTS)  # fmt: skip
    grid = stability_grid.cells(variants, updates, stale, stale_n, references)
    return grid, {cell.name: cell.overrides() for cell in grid}


def sweep_plan(args: argparse.Namespace) -> tuple[list[staleness_sweep.Cell], dict[str, dict[str, Any]]]:
    """The staleness sweep's cells (from the arguments, or --quick's few) and their overrides by name."""
    variants = args.variants or (staleness_sweep.QUICK_VARIANTS if args.quick else staleness_sweep.VARIANTS)
    ks = args.staleness or (staleness_sweep.QUICK_STALENESS if args.quick else staleness_sweep.STALENESS)
    sweep = staleness_sweep.cells(variants, list(dict.fromkeys(ks)))
    return sweep, {cell.name: cell.overrides(VARIANTS) for cell in sweep}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stale = args.staleness is not None
    grid, specs = grid_plan(args) if args.grid else sweep_plan(args) if stale else ([], VARIANTS)
    variants = (
        [c.name for c in grid]
        if args.grid or stale
        else (args.variants or (QUICK_VARIANTS if args.quick else list(VARIANTS)))
    )
    seeds = args.seeds or (QUICK_SEEDS if args.quick else [1, 2, 3, 4, 5] if args.grid else [1, 2, 3])
    try:
        given = parse_set(args.sets)
        if args.grid and (clash := sorted(set(given) & set(stability_grid.GRID_RESERVED))):
            raise ValueError(f"--set {clash[0]}: set per cell by --grid; choose cells with --updates")
        if stale and (clash := sorted(set(given) & set(staleness_sweep.SWEEP_RESERVED))):
            raise ValueError(f"--set {clash[0]}: set per cell by --staleness; choose K with --staleness")
        defaults = stability_grid.GRID_SETS if args.grid else staleness_sweep.SWEEP_SETS if stale else {}
        sets = {**(QUICK if args.quick else {}), **given}
        jobs = plan(variants, seeds, sets, args.work_dir.resolve(), specs, defaults)
    except ValueError as err:
        args.parser.error(str(err))
    from run import machine  # benchmarks/run.py: what the figures were measured on

    where = machine()  # before the runs: its load average says what else shared the cores
    start = time.perf_counter()
    if args.report_only:
        finished = {j: (j.run_dir / DONE).is_file() for j in jobs}
        outcomes = {j: Outcome("reused") if finished[j] else Outcome("failed", message=NOT_RUN) for j in jobs}
    else:
        outcomes = run_jobs(jobs, args.jobs)
    runs, colds = collect(jobs, outcomes)
    provenance = {
        "command": shlex.join(
            ["python", "benchmarks/reproduce.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "base_config": str(BASE_CONFIG.relative_to(REPO)),
        "overrides": [f"{k}={json.dumps(v)}" for k, v in {**HARNESS, **defaults, **sets}.items()],
        "variant_overrides": {n: [f"{k}={json.dumps(v)}" for k, v in specs[n].items()] for n in variants},
        "seeds": seeds,
        "jobs": args.jobs,
        "wall_seconds": time.perf_counter() - start,
        "machine": where,
    }
    references = frozenset(c.name for c in grid if args.grid and c.bf16_rollouts)
    report = assemble(
        runs, colds, variants, target=args.target, gain=args.target_gain, provenance=provenance,
        other_rollouts=references,
    )  # fmt: skip
    if args.grid:
        written = stability_grid.write(report, runs, grid, args.out)
    elif stale:
        written = staleness_sweep.write(report, runs, grid, args.out)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(report, indent=1))
        (args.out / "summary.md").write_text(markdown(report))
        plot(report, args.out / "reproduce.png")
        written = ["summary.md", "summary.json", "reproduce.png"]
    unrun = sum(outcomes[job].message == NOT_RUN for job in jobs)
    failed = [
        job.label for job in jobs if outcomes[job].status == "failed" and outcomes[job].message != NOT_RUN
    ]
    print(
        f"wrote {args.out}/{', '.join(written)}"
        + (f"; {unrun} of {len(jobs)} runs not finished yet" if unrun else "")
        + (f"; FAILED: {failed}" if failed else "")
    )
    return 1 if failed or unrun else 0


if __name__ == "__main__":
    sys.exit(main())
