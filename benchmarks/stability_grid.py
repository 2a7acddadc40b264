"""The stability grid of `reproduce.py --grid`: updates per rollout batch x variant, FP8 rollouts.

The two gaps that decide whether a token-level policy gradient stays a valid surrogate of the
sequence reward (Zheng et al., "Stabilizing Reinforcement Learning with LLMs: Formulation and
Practices", arXiv 2512.01374) are the training-inference discrepancy and policy staleness. Here
the first is FP8 rollouts (`rollout.quantization=fp8`, blockwise e4m3 weights on the rollout
server) against a bf16 trainer, the second is N, the optimizer steps per rollout batch
(`algorithm.num_mini_batches=N`, one pass: N = 1 is on-policy), and, in separate cells,
`rollout.max_staleness=2` (batches sampled up to two weight versions behind the trainer).

Variants (GRPO clip 0.2 / 0.27; "TIS" is token-level truncated IS, w = min(pi_old / pi_rollout,
2), with pi_old the trainer's recompute, the paper's MiniRL correction):

- grpo: GRPO, pi_old recomputed, no correction (the rollout's log-probs are not used).
- grpo_tis: GRPO + token TIS.
- grpo_tis_r2 / grpo_tis_r3: GRPO + token TIS + Routing Replay R2 / R3 (the paper's R2 / R3
  runs sit on MiniRL, which carries the correction).
- gspo / gspo_r3: GSPO as the project runs it (pi_old = the rollout server's log-probs, so the
  sequence ratio and its clip see the FP8 mismatch), without / with R3.

Staleness cells (`--stale-variants`, default GSPO, GRPO + TIS + R2 and GRPO + TIS + R3) take any
variant; R3 at staleness k replays the routes of the weights that sampled the batch (k versions
old), which the rollout server returned with it.

Reference cells (`--reference-variants`, default GRPO and GSPO, at N = 1) run with bf16 rollouts
(`rollout.quantization=none`) against the same bf16 trainer: the mismatch the FP8 cells add is
their rollout/trainer k3 KL and infer->train drift above these.

This module defines the cells and writes the grid's summary.md, summary.json and figure from the
report `reproduce_report.assemble` builds (one "variant" there per cell).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cell_report import accuracy_text, cell_accuracies, every_cell_table, mean_or_none, write_report
from reproduce_report import Run, markdown, series

# Every run of the grid (and its cold starts): FP8 rollouts (but the reference cells'), bf16
# trainer, the lr at which the drift config learns with bf16 rollouts (3e-4, warm-up 4, as the
# probe that located the regime). The per-cell overrides come after these, except for `--set`.
GRID_SETS: dict[str, Any] = {
    "rollout.quantization": "fp8",
    "engine.dtype": "bf16",
    "optim.lr": 3e-4,
    "optim.lr_warmup_steps": 4,
}
GRPO = {"algorithm.loss_type": "grpo", "algorithm.loss_options": {"clip_low": 0.2, "clip_high": 0.27}}
RECOMPUTE = {"algorithm.old_logprobs": "recompute"}
TOKEN_TIS = {**RECOMPUTE, "algorithm.rollout_correction": {"method": "tis", "level": "token", "cap": 2.0}}
GRID_VARIANTS: dict[str, dict[str, Any]] = {
    "grpo": {**GRPO, **RECOMPUTE},
    "grpo_tis": {**GRPO, **TOKEN_TIS},
    "grpo_tis_r2": {**GRPO, **TOKEN_TIS, "algorithm.routing_replay": "r2"},
    "grpo_tis_r3": {**GRPO, **TOKEN_TIS, "algorithm.routing_replay": "r3"},
    "gspo": {},
    "gspo_r3": {"algorithm.routing_replay": "r3"},
}
UPDATES = [1, 4, 8, 16]
STALE_KEY = "rollout/staleness_mean"  # versions between the sampling weights and the trainer's
STALENESS, STALE_UPDATES, STALE_VARIANTS = 2, 16, ["gspo", "grpo_tis_r2", "grpo_tis_r3"]
REFERENCE_VARIANTS = ["grpo", "gspo"]  # at N = 1 with bf16 rollouts: the mismatch without FP8
# Set per cell: a --set of these would silently turn every cell into the same one.
GRID_RESERVED = ("algorithm.num_mini_batches", "algorithm.ppo_epochs", "rollout.max_staleness")
# --quick --grid: two values of N, one variant, one stale cell (on the quick model of reproduce.py).
QUICK_UPDATES, QUICK_VARIANTS, QUICK_STALE = [1, 2], ["grpo_tis"], (2, ["gspo"])


@dataclass(frozen=True)
class Cell:
    """One cell of the grid: a variant at N updates per rollout batch, a staleness bound, rollouts."""

    variant: str
    updates: int
    staleness: int = 0
    bf16_rollouts: bool = False  # a reference cell: the grid's FP8 rollouts turned off

    @property
    def name(self) -> str:
        stale = f"+stale{self.staleness}" if self.staleness else ""
        return f"{self.variant}@N{self.updates}{stale}" + ("+bf16rollouts" if self.bf16_rollouts else "")

    def overrides(self) -> dict[str, Any]:
        """The variant's overrides with this cell's N (one pass over the batch), staleness, rollouts."""
        return {
            **GRID_VARIANTS[self.variant],
            "algorithm.num_mini_batches": self.updates,
            "algorithm.ppo_epochs": 1,
            "rollout.max_staleness": self.staleness,
            **({"rollout.quantization": "none"} if self.bf16_rollouts else {}),
        }


def cells(
    variants: list[str],
    updates: list[int],
    stale_variants: list[str],
    stale_updates: int,
    reference_variants: Sequence[str] = (),
) -> list[Cell]:
    """Every (variant, N) at staleness 0, the stale cells (at `stale_updates`), the bf16 references."""
    grid = [Cell(v, n) for v in variants for n in updates]
    grid += [Cell(v, stale_updates, STALENESS) for v in stale_variants]
    return grid + [Cell(v, 1, bf16_rollouts=True) for v in reference_variants]


def last_update_drift(run: Run, updates: int) -> float | None:
    """Old->new drift on the batch's last mini-batch (after N-1 updates), mean over the RL steps."""
    if updates < 2:
        return None
    return mean_or_none([v for _, v in series(run.records, f"drift/old_new_mb{updates - 1}/mean")])


def grid_section(report: dict[str, Any], runs: list[Run], grid: list[Cell]) -> dict[str, Any]:
    """Per cell: variant, N, staleness, the seeds' final / best accuracies and the grid's columns."""
    out = []
    for cell in grid:
        v = report["variants"][cell.name]
        mine = [r for r in runs if r.variant == cell.name and r.status != "failed"]
        means = v.get("means", {})
        drift_last = [d for r in mine if (d := last_update_drift(r, cell.updates)) is not None]
        out.append(
            {
                **cell_accuracies(report, cell.name),
                "variant": cell.variant,
                "updates": cell.updates,
                "staleness": cell.staleness,
                "bf16_rollouts": cell.bf16_rollouts,
                "k3_kl": means.get("rollout/k3_kl"),
                "infer_train": means.get("drift/infer_train/mean"),
                "drift_1_update": means.get("drift/old_new_mb1/mean"),
                "drift_last_update": mean_or_none(drift_last),
                "drift_mean_1_to_last": means.get("drift/old_new/mean"),
                "clip_label": v.get("clip_label"),
                "clip": v.get("clip_mean"),
                "clipped_tokens": means.get("actor/clipfrac_tokens"),
                "clipped_sequences": means.get("actor/clipfrac_seq"),
                "staleness_mean": mean_or_none([v for r in mine for _, v in series(r.records, STALE_KEY)]),
                "s_per_step": means.get("time/step_s"),
            }
        )
    return {"cells": out, "updates": sorted({c.updates for c in grid}), "variants": list(dict.fromkeys(
        c.variant for c in grid))}  # fmt: skip


def grid_markdown(report: dict[str, Any]) -> str:
    """summary.md of the grid: accuracy and collapse by variant x N, every column per cell, details."""
    grid = report["grid"]
    by = {(c["variant"], c["updates"], c["staleness"]): c for c in grid["cells"] if not c["bf16_rollouts"]}
    header = "| variant | " + " | ".join(f"N={n}" for n in grid["updates"]) + " |"
    rule = "|---|" + "---|" * len(grid["updates"])
    lines = [
        "# Stability grid: FP8 rollouts, bf16 trainer, N updates per rollout batch",
        "",
        "N = optimizer steps per rollout batch (`algorithm.num_mini_batches`, one pass; N = 1 is "
        "on-policy). Variants: `grpo` (pi_old recomputed, no correction), `grpo_tis` (+ token TIS, "
        "cap 2), `grpo_tis_r2` / `grpo_tis_r3` (+ Routing Replay), `gspo` / `gspo_r3` (pi_old = the FP8 "
        "server's log-probs). Stale cells: `rollout.max_staleness=2`. Reference cells (`+bf16rollouts`): "
        "bf16 rollouts against the same bf16 trainer. Definitions of collapse, final and "
        "best below (Details).",
        "",
        "Final held-out accuracy (mean ± sample std over seeds):",
        "",
        header,
        rule,
    ]
    for variant in grid["variants"]:
        row = [accuracy_text(by[variant, n, 0]) if (variant, n, 0) in by else "" for n in grid["updates"]]
        lines.append(f"| {variant} | " + " | ".join(row) + " |")
    lines += ["", "Best held-out accuracy after step 0 (mean over seeds) / collapsed runs:", "", header, rule]
    for variant in grid["variants"]:
        row = []
        for n in grid["updates"]:
            c = by.get((variant, n, 0))
            row.append(
                ""
                if c is None or not c["runs"]
                else f"{accuracy_text(c, 'best')} / {c['collapsed']}/{c['judged']}"
            )
        lines.append(f"| {variant} | " + " | ".join(row) + " |")
    columns = [
        ("cold start", "cold_start"), ("final", None), ("best", "best_mean"), ("collapsed", None),
        ("k3 KL rollout/trainer", "k3_kl"), ("infer->train drift", "infer_train"),
        ("old->new drift, 1 update", "drift_1_update"), ("after N-1 updates", "drift_last_update"),
        ("mean over mb 1..N-1", "drift_mean_1_to_last"), ("clipped tokens", "clipped_tokens"),
        ("clipped sequences", "clipped_sequences"), ("staleness (versions)", "staleness_mean"),
        ("s/step", "s_per_step"),
    ]  # fmt: skip
    lines += [
        "",
        "Every cell (means over RL steps, then seeds; drift = fraction of top-k expert choices that differ "
        "from pi_old's; GRPO's clip acts on tokens, GSPO's on sequences):",
        "",
        *every_cell_table(grid["cells"], columns),
    ]
    details = markdown(report).split("\n", 1)[1]  # the per-cell, per-run and cold-start tables, provenance
    return "\n".join(lines) + "\n\n## Details (one 'variant' per cell)\n" + details


def plot_grid(report: dict[str, Any], path: Path) -> None:
    """Final held-out accuracy against N, one colour per variant, one point per seed, means joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = report["grid"]
    positions = {n: i for i, n in enumerate(grid["updates"])}
    fig, ax = plt.subplots(figsize=(10, 6))
    width = 0.6 / max(len(grid["variants"]), 1)
    for k, variant in enumerate(grid["variants"]):
        offset = -0.3 + (k + 0.5) * width
        mine = [c for c in grid["cells"] if c["variant"] == variant and c["runs"]]
        fresh = [c for c in mine if not c["staleness"] and not c["bf16_rollouts"]]
        xs = [positions[c["updates"]] + offset for c in fresh]
        (line,) = ax.plot(xs, [c["final_mean"] for c in fresh], "-", lw=1.2, label=variant)
        for c in mine:
            x = positions[c["updates"]] + offset
            marker = "x" if c["staleness"] else "s" if c["bf16_rollouts"] else "o"
            finals = list(c["finals"].values())
            ax.scatter([x] * len(finals), finals, color=line.get_color(), marker=marker, s=18, alpha=0.8)
    colds = [c["accuracy"] for c in report["cold_starts"] if c["accuracy"] is not None]
    if colds:
        ax.axhline(statistics.mean(colds), color="grey", ls="--", lw=1, label="cold start (mean over seeds)")
    ax.scatter([], [], color="grey", marker="x", label=f"max_staleness={STALENESS} (at its N)")
    ax.scatter([], [], color="grey", marker="s", label="bf16 rollouts (reference)")
    ax.set_xticks(range(len(grid["updates"])), [str(n) for n in grid["updates"]])
    ax.set_xlabel("N: optimizer steps per rollout batch")
    ax.set_ylabel("final held-out accuracy")
    ax.set_title(
        "FP8 rollouts, bf16 trainer: final held-out accuracy per seed (points), mean (lines)", fontsize=10
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: dict[str, Any], runs: list[Run], grid: list[Cell], out: Path) -> list[str]:
    """summary.json, summary.md and stability_grid.png in `out`; returns the file names."""
    report = {**report, "grid": grid_section(report, runs, grid)}
    return write_report(report, out, grid_markdown, plot_grid, "stability_grid.png")
