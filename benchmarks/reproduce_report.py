"""What `reproduce.py` writes from finished runs: summary.md, summary.json and one figure.

Each run is one `megatron-gspo train` whose metrics.jsonl has a step-0 record (the cold start's
held-out accuracy) and one record per RL step. Per run this module extracts curves (held-out
accuracy, training reward, clip fraction, inference->training drift, rollout/trainer k3 KL,
step time), means over the RL steps, a collapse verdict and the steps to a target accuracy;
per variant it aggregates the runs over seeds (mean, std, min..max band).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Means over a run's RL steps (steps whose advantages are all zero log no actor/drift keys).
MEAN_KEYS = {
    "actor/clipfrac_seq": "clipped sequences",
    "actor/clipfrac_tokens": "clipped tokens",
    "drift/old_new_mb1/mean": "old->new drift, 1 update",
    "drift/old_new/mean": "old->new drift, mb 1..M-1",
    "drift/infer_train/mean": "infer->train drift",
    "rollout/k3_kl": "rollout/trainer k3 KL",
    "rollout/reward_mean": "train reward",
    "time/step_s": "s/step",
}
REWARD = "rollout/reward_mean"
ACCURACY = "eval/accuracy"
OLD_NEW_LAYER = "drift/old_new/layer_"

# Collapse: training reward below COLLAPSE_FRACTION of RL step 1's on each of the last K steps,
# K = max(MIN_TAIL, ceil(steps x TAIL_FRACTION)). Step 1 is the reference because its rollouts come
# from the cold-start weights themselves; at a high lr the policy can halve its reward by step 2,
# so a mean over the first steps would already include the fall.
COLLAPSE_FRACTION, MIN_TAIL, TAIL_FRACTION = 0.5, 3, 0.2
COLLAPSE_DEFINITION = (
    f"a run **collapsed** when its training reward (`{REWARD}`, mean over the step's responses) is "
    f"below {COLLAPSE_FRACTION:.0%} of RL step 1's (sampled from the cold-start weights, before any "
    f"update) on every one of its last K steps, K = max({MIN_TAIL}, ceil({TAIL_FRACTION:g} x steps)): "
    "it fell and stayed down. The collapse step is the first step of that final streak. Runs shorter "
    "than 1 + K steps are not judged (n/a)."
)


@dataclass
class Run:
    """One finished (or failed) RL run of a variant and seed, as the harness hands it over."""

    variant: str
    seed: int
    loss_type: str
    status: str
    """finished, reused (finished earlier) or failed."""
    log: str
    records: list[dict[str, Any]] = field(default_factory=list)
    """metrics.jsonl of the run (empty when it failed)."""
    message: str = ""


@dataclass
class ColdStart:
    """One seed's cold start (SFT, then the held-out accuracy of the weights every variant starts from)."""

    seed: int
    status: str
    log: str
    records: list[dict[str, Any]] = field(default_factory=list)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of every record holding a finite `key`."""
    return [
        (r["step"], float(r[key]))
        for r in records
        if isinstance(r.get(key), int | float) and math.isfinite(r[key])
    ]


def clip_series(records: list[dict[str, Any]], loss_type: str) -> tuple[str, list[tuple[int, float]]]:
    """The clip fraction that matters for a loss: sequences (GSPO), tokens (GRPO), gate (SAPO).

    SAPO has no hard clip; what it suppresses is 1 - its gradient weight 4p(1-p)
    (`actor/sapo_gate_weight`, 1 on-policy), reported in the clip's place.
    """
    if loss_type == "sapo":
        gate = series(records, "actor/sapo_gate_weight")
        return "1 - sapo gate weight", [(s, 1.0 - v) for s, v in gate]
    if loss_type.startswith("gspo"):
        return "clipped sequences", series(records, "actor/clipfrac_seq")
    return "clipped tokens", series(records, "actor/clipfrac_tokens")


def collapse(rewards: list[float]) -> dict[str, Any]:
    """`{"collapsed": bool or None, "step": first step of the final streak or None}` (see definition).

    Args:
        rewards: training reward of RL steps 1, 2, ... in order.
    """
    tail = max(MIN_TAIL, math.ceil(TAIL_FRACTION * len(rewards)))
    if len(rewards) < 1 + tail:
        return {"collapsed": None, "step": None}
    threshold = COLLAPSE_FRACTION * rewards[0]
    streak = 0
    for value in reversed(rewards):
        if value >= threshold:
            break
        streak += 1
    collapsed = streak >= tail
    return {"collapsed": collapsed, "step": len(rewards) - streak + 1 if collapsed else None}


def steps_to(evals: list[tuple[int, float]], target: float) -> int | None:
    """The first RL step whose held-out accuracy reaches `target` (None: never)."""
    return next((step for step, acc in evals if step > 0 and acc >= target), None)


def summarise_run(run: Run, target: float | None, gain: float) -> dict[str, Any]:
    """Figures and curves of one finished run; `target` None means cold start + `gain`."""
    records = run.records
    evals = series(records, ACCURACY)
    if not evals or evals[0][0] != 0:
        raise ValueError(f"{run.log}: no step-0 held-out accuracy in metrics.jsonl (eval.at_start off?)")
    rewards = series(records, REWARD)
    clip_label, clip = clip_series(records, run.loss_type)
    wanted = target if target is not None else evals[0][1] + gain
    layers = sorted(
        {k for r in records for k in r if k.startswith(OLD_NEW_LAYER)}, key=lambda k: int(k.rsplit("_", 1)[1])
    )
    return {
        "variant": run.variant,
        "seed": run.seed,
        "status": run.status,
        "log": run.log,
        "steps": max(r["step"] for r in records),
        "cold_start": evals[0][1],
        "final": evals[-1][1],
        "best": max((acc for step, acc in evals if step > 0), default=None),
        "target": wanted,
        "steps_to_target": steps_to(evals, wanted),
        **{f"collapse_{k}": v for k, v in collapse([v for _, v in rewards]).items()},
        "means": {key: _mean([v for _, v in series(records, key)]) for key in MEAN_KEYS},
        "clip_label": clip_label,
        "clip_mean": _mean([v for _, v in clip]),
        "old_new_per_layer": [_mean([v for _, v in series(records, k)]) for k in layers],
        "curves": {
            "accuracy": evals,
            "reward": rewards,
            "clip": clip,
            "infer_train": series(records, "drift/infer_train/mean"),
            "k3_kl": series(records, "rollout/k3_kl"),
            "step_s": series(records, "time/step_s"),
        },
    }


def band(curves: list[list[tuple[int, float]]]) -> list[tuple[int, float, float, float]]:
    """(step, mean, min, max) over runs at every step any run logged."""
    by_step: dict[int, list[float]] = {}
    for curve in curves:
        for step, value in curve:
            by_step.setdefault(step, []).append(value)
    return [(s, statistics.mean(v), min(v), max(v)) for s, v in sorted(by_step.items())]


def summarise_variant(rows: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """Mean / std over the seeds' runs of one variant (`total`: runs asked for, failed included)."""
    if not rows:
        return {"runs": 0, "of": total}
    finals = [r["final"] for r in rows]
    reached = [r["steps_to_target"] for r in rows if r["steps_to_target"] is not None]
    judged = [r for r in rows if r["collapse_collapsed"] is not None]
    layers = [r["old_new_per_layer"] for r in rows if r["old_new_per_layer"]]
    return {
        "runs": len(rows),
        "of": total,
        "cold_start": statistics.mean(r["cold_start"] for r in rows),
        "final_mean": statistics.mean(finals),
        "final_std": statistics.stdev(finals) if len(finals) > 1 else None,
        "best_mean": _mean([r["best"] for r in rows if r["best"] is not None]),
        "reached_target": len(reached),
        "steps_to_target_mean": _mean(reached),
        "collapsed": sum(bool(r["collapse_collapsed"]) for r in judged),
        "judged": len(judged),
        "clip_label": rows[0]["clip_label"],
        "clip_mean": _mean([r["clip_mean"] for r in rows if r["clip_mean"] is not None]),
        "means": {
            key: _mean([r["means"][key] for r in rows if r["means"][key] is not None]) for key in MEAN_KEYS
        },
        "old_new_per_layer": [statistics.mean(col) for col in zip(*layers)] if layers else [],
        "curves": {name: band([r["curves"][name] for r in rows]) for name in rows[0]["curves"]},
    }


def assemble(
    runs: list[Run],
    colds: list[ColdStart],
    variants: list[str],
    *,
    target: float | None,
    gain: float,
    provenance: dict[str, Any],
    other_rollouts: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Everything summary.json holds: per-run and per-variant figures, cold starts, provenance.

    `other_rollouts`: variants whose rollout engine differs from the cold start's (the grid's bf16
    references): they evaluate step 0 on other numerics, so the same-start check leaves them out.
    """
    rows = [summarise_run(r, target, gain) for r in runs if r.status != "failed"]
    failed = [
        {"variant": r.variant, "seed": r.seed, "status": r.status, "log": r.log, "message": r.message}
        for r in runs
        if r.status == "failed"
    ]
    cold_rows = []
    for c in colds:
        start = c.records[0] if c.records else {}
        starts = [r["cold_start"] for r in rows if r["seed"] == c.seed and r["variant"] not in other_rollouts]
        cold_rows.append({
            "seed": c.seed, "status": c.status, "log": c.log,
            "accuracy": start.get(ACCURACY), "sft_steps": start.get("sft/steps"),
            "sft_seconds": start.get("sft/seconds"), "variant_starts": starts,
            "same_start": len(set(starts + [start.get(ACCURACY)] * bool(start))) <= 1,
        })  # fmt: skip
    totals = {name: sum(r.variant == name for r in runs) for name in variants}
    return {
        **provenance,
        "target": {"absolute": target, "gain": gain},
        "collapse_definition": COLLAPSE_DEFINITION,
        "variants": {
            name: summarise_variant([r for r in rows if r["variant"] == name], totals[name])
            for name in variants
        },
        "runs": sorted(rows + failed, key=lambda r: (variants.index(r["variant"]), r["seed"])),
        "cold_starts": cold_rows,
    }


def _mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def markdown(report: dict[str, Any]) -> str:
    """summary.md: definitions, the per-variant table, the per-seed table, cold starts, provenance."""
    target = report["target"]
    target_text = (
        f"held-out accuracy >= {target['absolute']}"
        if target["absolute"] is not None
        else f"held-out accuracy >= the run's cold start + {target['gain']}"
    )
    lines = [
        "# GSPO vs GRPO (with and without Routing Replay) on a drifting tiny MoE",
        "",
        "Definitions:",
        f"- {COLLAPSE_DEFINITION}",
        f"- **steps to target**: the first RL step whose evaluation reaches the target, {target_text} "
        "(evaluations every `eval.every` steps and at the end); `k/n` seeds reached it, mean steps of those.",
        "- **final / best**: held-out greedy accuracy at the last evaluation / the best after step 0; "
        "mean ± sample std over seeds. Other columns: means over RL steps, then over seeds.",
        "- **clip**: clipped sequences for GSPO losses, clipped tokens for GRPO, 1 - gate weight for SAPO.",
        "- old->new drift: fraction of top-k expert choices that differ from pi_old's, after 1 update "
        "(mini-batch 1) and over mini-batches 1..M-1; infer->train: rollout server vs trainer on the "
        "same weights.",
        "",
        "| variant | runs | cold start | final | best | steps to target | collapsed | clip | "
        + " | ".join(MEAN_KEYS.values())
        + " |",
        "|" + "---|" * (8 + len(MEAN_KEYS)),
    ]
    for name, v in report["variants"].items():
        if not v["runs"]:
            lines.append(f"| {name} | 0/{v['of']} |" + " - |" * (6 + len(MEAN_KEYS)))
            continue
        std = "" if v["final_std"] is None else f" ± {v['final_std']:.3f}"
        lines.append(
            f"| {name} | {v['runs']}/{v['of']} | {v['cold_start']:.3f} | {v['final_mean']:.3f}{std} | "
            f"{_fmt(v['best_mean'])} | {v['reached_target']}/{v['runs']}, "
            f"{_fmt(v['steps_to_target_mean'])} | "
            f"{v['collapsed']}/{v['judged']} | {_fmt(v['clip_mean'])} | "
            + " | ".join(_fmt(v["means"][k]) for k in MEAN_KEYS)
            + " |"
        )
    lines += [
        "",
        "Per run:",
        "",
        "| variant | seed | status | steps | cold start | final | best | target | steps to target | "
        "collapsed (step) | clip | s/step | log |",
        "|" + "---|" * 13,
    ]
    for r in report["runs"]:
        if r["status"] == "failed":
            lines.append(
                f"| {r['variant']} | {r['seed']} | failed: {r['message']} |" + " - |" * 9 + f" {r['log']} |"
            )
            continue
        verdict = {None: "n/a", False: "no", True: f"yes ({r['collapse_step']})"}[r["collapse_collapsed"]]
        lines.append(
            f"| {r['variant']} | {r['seed']} | {r['status']} | {r['steps']} | {r['cold_start']:.3f} | "
            f"{r['final']:.3f} | {_fmt(r['best'])} | {r['target']:.3f} | {_fmt(r['steps_to_target'])} | "
            f"{verdict} | {_fmt(r['clip_mean'])} | {_fmt(r['means']['time/step_s'])} | {r['log']} |"
        )
    lines += ["", "Cold starts (one SFT per seed, shared by every variant of that seed):", ""]
    lines += [
        "| seed | status | held-out | SFT steps | SFT s | every variant starts RL at | log |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in report["cold_starts"]:
        starts = ", ".join(f"{a:.3f}" for a in c["variant_starts"]) or "-"
        same = "same" if c["same_start"] else "DIFFERENT"
        lines.append(
            f"| {c['seed']} | {c['status']} | {_fmt(c['accuracy'])} | {_fmt(c['sft_steps'])} | "
            f"{_fmt(c['sft_seconds'])} | {starts} ({same}) | {c['log']} |"
        )
    lines += [
        "",
        "## How this was run",
        "",
        f"    {report['command']}",
        "",
        f"- base config: `{report['base_config']}`",
        f"- overrides of every run (harness, then `--set`): `{' '.join(report['overrides'])}`",
        "- variants (on top of those):",
        *[
            f"  - {name}: `{' '.join(spec) or '(base config)'}`"
            for name, spec in report["variant_overrides"].items()
        ],
        f"- wall time: {report['wall_seconds']:.0f} s with {report['jobs']} job(s) at once",
        *[f"- {k}: {v}" for k, v in report["machine"].items()],
        "",
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """One PNG, six panels: accuracy, reward, clip, old->new drift per layer, infer->train drift, k3 KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = {n: v for n, v in report["variants"].items() if v["runs"]}
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    panels = [
        (axes[0, 0], "accuracy", "held-out accuracy", True),
        (axes[0, 1], "reward", "training reward", True),
        (axes[0, 2], "clip", "clipped: GSPO seqs, GRPO tokens, SAPO 1 - gate", False),
        (axes[1, 1], "infer_train", "infer->train drift (top-k choices)", False),
        (axes[1, 2], "k3_kl", "rollout/trainer k3 KL", False),
    ]
    for ax, curve, title, with_band in panels:
        for name, v in variants.items():
            points = v["curves"][curve]
            if not points:
                continue
            steps, mean, lo, hi = zip(*points)
            (line,) = ax.plot(steps, mean, marker="o" if curve == "accuracy" else None, ms=3, label=name)
            if with_band and v["runs"] > 1:
                ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_title(
            title + (" (mean, band: min..max over seeds)" if with_band else " (mean over seeds)"), fontsize=9
        )
        ax.set_xlabel("RL step")
    ax = axes[1, 0]
    width = 0.8 / max(len(variants), 1)
    for i, (name, v) in enumerate(variants.items()):
        layers = v["old_new_per_layer"]
        ax.bar(
            [layer - 0.4 + (i + 0.5) * width for layer in range(len(layers))], layers, width=width, label=name
        )
        ax.set_xticks(range(len(layers)))
    ax.set_title("old->new drift per layer, mb 1..M-1 (mean over steps and seeds)", fontsize=9)
    ax.set_xlabel("layer")
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
