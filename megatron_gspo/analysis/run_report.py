"""`megatron-gspo report RUN_DIR`: a run's metrics.jsonl as one self-contained HTML page.

    megatron-gspo report runs/tiny_moe_cpu/2026-01-01_12-00-00          -> RUN_DIR/report.html
    megatron-gspo report RUN_DIR --out /tmp/run.html

Panels (each drawn only when the run logged it, else a line saying how to get it): training
reward and held-out accuracy, KL (rollout vs trainer k3, and any KL the loss logged), clip
fractions, the rollout/trainer log-prob mismatch by response length, and the per-layer routing
drift over steps as heatmaps (`drift.enabled=true`). Figures are matplotlib PNGs embedded as
base64, so the page opens offline and can be mailed as one file; a table gives the first, last,
min and max of the key numbers, and the run's config.yaml follows.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_gspo.config import ConfigError
from megatron_gspo.training.metrics import read_metrics

REWARD_KEYS = ("rollout/reward_mean",)
ACCURACY_KEYS = ("eval/accuracy",)
SUMMARY_KEYS = (
    "rollout/reward_mean",
    "eval/accuracy",
    "rollout/k3_kl",
    "rollout/logprob_mismatch_mean",
    "actor/clipfrac_seq",
    "actor/clipfrac_tokens",
    "actor/entropy",
    "train/grad_norm",
    "drift/old_new/mean",
    "drift/infer_train/mean",
    "time/step_s",
)
_KL = re.compile(r"(^|/)([a-z0-9_]*kl[a-z0-9_]*)$")
_CLIP = re.compile(r"^actor/clipfrac")
_IN_BUCKET = re.compile(r"^rollout/mismatch_by_len/")
_MISMATCH_BY_LEN = re.compile(r"^rollout/mismatch_by_len/([^/]+)/abs_diff_mean$")
_LAYER = re.compile(r"^drift/([^/]+)/layer_(\d+)$")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the records that logged a finite number for it."""
    points = [(r["step"], _number(r.get(key))) for r in records if "step" in r]
    points = [(s, v) for s, v in points if v is not None]
    return [s for s, _ in points], [v for _, v in points]


def keys_matching(records: Sequence[dict], pattern: re.Pattern) -> list[str]:
    """Sorted metric keys matching `pattern` that any record holds."""
    return sorted({k for r in records for k in r if pattern.search(k)})


def drift_heatmap(records: Sequence[dict], kind: str) -> tuple[list[int], list[int], list[list[float]]]:
    """Per-layer drift of `kind` (old_new, infer_train, ...) over the steps that measured it.

    Returns:
        (steps, layers, matrix) with matrix[layer][j] the fraction of top-k choices that changed
        in that layer at steps[j] (`drift/{kind}/layer_{i}`); empty lists when never logged.
    """
    layers = sorted(
        {int(m.group(2)) for r in records for k in r if (m := _LAYER.match(k)) and m.group(1) == kind}
    )
    rows = [r for r in records if any(_number(r.get(f"drift/{kind}/layer_{i}")) is not None for i in layers)]
    steps = [r["step"] for r in rows]
    matrix = [[_number(r.get(f"drift/{kind}/layer_{i}")) for r in rows] for i in layers]
    return steps, layers, [[math.nan if v is None else v for v in row] for row in matrix]


def _bucket_order(label: str) -> int:
    return int(re.match(r"\d+", label).group())


def mismatch_by_length(records: Sequence[dict]) -> tuple[list[int], list[str], list[list[float]]]:
    """Mean |trainer - rollout| log-prob per response-length bucket over steps (NaN: bucket empty)."""
    buckets = sorted(
        {m.group(1) for k in keys_matching(records, _MISMATCH_BY_LEN) if (m := _MISMATCH_BY_LEN.match(k))},
        key=_bucket_order,
    )
    key = "rollout/mismatch_by_len/{}/abs_diff_mean"
    rows = [r for r in records if any(_number(r.get(key.format(b))) is not None for b in buckets)]
    matrix = [[_number(r.get(key.format(b))) for r in rows] for b in buckets]
    return [r["step"] for r in rows], buckets, [[math.nan if v is None else v for v in row] for row in matrix]


# ----------------------------------------------------------------------------- figures


def _plt():
    from megatron_gspo.optional import require

    matplotlib = require("matplotlib", "megatron-gspo report's figures")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> str:
    """The figure as a base64 PNG (closed afterwards)."""
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=90)
    _plt().close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def lines_figure(records: Sequence[dict], keys: Sequence[str], ylabel: str, log: bool = False) -> str | None:
    """One line per key over steps; None when no key has a value."""
    plotted = [(k, *series(records, k)) for k in keys]
    plotted = [(k, s, v) for k, s, v in plotted if s]
    if not plotted:
        return None
    fig, ax = _plt().subplots(figsize=(7, 3.2))
    for key, steps, values in plotted:
        ax.plot(steps, values, marker="." if len(steps) < 60 else None, label=key)
    if log and all(v > 0 for _, _, vs in plotted for v in vs):
        ax.set_yscale("log")
    ax.set(xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)


def heatmap_figure(steps, rows, matrix, ylabel: str, colorbar: str, row_name=str) -> str | None:
    """matrix[row][j] at steps[j] as a heatmap; None when empty."""
    if not steps or not rows:
        return None
    import numpy as np

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.6))
    data = np.ma.masked_invalid(np.asarray(matrix, dtype=float))
    image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower")
    ticks = np.linspace(0, len(steps) - 1, min(len(steps), 10)).round().astype(int)
    ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
    ax.set_yticks(range(len(rows)), [row_name(r) for r in rows])
    ax.set(xlabel="step", ylabel=ylabel)
    fig.colorbar(image, ax=ax, label=colorbar)
    return _png(fig)


# ----------------------------------------------------------------------------- page


def summary_rows(records: Sequence[dict]) -> list[tuple[str, float, float, float, float, int]]:
    """(key, first, last, min, max, points) of each summary key the run logged."""
    rows = []
    for key in SUMMARY_KEYS:
        _, values = series(records, key)
        if values:
            rows.append((key, values[0], values[-1], min(values), max(values), len(values)))
    return rows


def _section(title: str, png: str | None, missing: str) -> str:
    body = (
        f'<img alt="{html.escape(title)}" src="data:image/png;base64,{png}">'
        if png
        else f'<p class="missing">{html.escape(missing)}</p>'
    )
    return f"<h2>{html.escape(title)}</h2>\n{body}\n"


def render_html(records: Sequence[dict], title: str, config_text: str | None = None) -> str:
    """The whole page (no external resource: styles inline, figures as data URIs)."""
    kl_keys = [k for k in keys_matching(records, _KL) if not _IN_BUCKET.match(k)]
    clip_keys = keys_matching(records, _CLIP)
    steps = [r["step"] for r in records if "step" in r]
    sections = [
        _section(
            "Training reward", lines_figure(records, REWARD_KEYS, "mean reward"), "no rollout/reward_mean"
        ),
        _section(
            "Held-out accuracy",
            lines_figure(records, ACCURACY_KEYS, "greedy accuracy"),
            "no eval/accuracy (eval.every > 0 evaluates held-out problems)",
        ),
        _section("KL", lines_figure(records, kl_keys, "KL", log=True), "no KL metric logged"),
        _section(
            "Clip fractions", lines_figure(records, clip_keys, "fraction clipped"), "no actor/clipfrac_*"
        ),
        _section(
            "Rollout/trainer log-prob mismatch by response length",
            heatmap_figure(*mismatch_by_length(records), "response length", "mean |diff| log-prob"),
            "no rollout/mismatch_by_len/* metrics",
        ),
    ]
    for kind, what in (("old_new", "pi_old -> pi_theta"), ("infer_train", "inference -> training")):
        layer_steps, layers, matrix = drift_heatmap(records, kind)
        sections.append(
            _section(
                f"Routing drift per layer ({what})",
                heatmap_figure(layer_steps, layers, matrix, "layer", "top-k choices changed"),
                f"no drift/{kind}/layer_* metrics (drift.enabled=true measures them)",
            )
        )
    table = "".join(
        f"<tr><td>{html.escape(key)}</td>"
        + "".join(f"<td>{v:.4g}</td>" for v in (first, last, low, high))
        + f"<td>{n}</td></tr>\n"
        for key, first, last, low, high, n in summary_rows(records)
    )
    config = f"<h2>Config</h2>\n<pre>{html.escape(config_text)}</pre>\n" if config_text else ""
    span = f"steps {min(steps)}-{max(steps)}, {len(records)} records" if steps else "no records"
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title>\n<style>"
        "body{font-family:sans-serif;max-width:60em;margin:1em auto;color:#222}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        "td:first-child{text-align:left}.missing{color:#888}pre{background:#f6f6f6;padding:.5em}"
        "img{max-width:100%}</style></head><body>\n"
        f"<h1>{html.escape(title)}</h1>\n<p>{html.escape(span)}</p>\n"
        "<table><tr><th>metric</th><th>first</th><th>last</th><th>min</th><th>max</th><th>points</th></tr>\n"
        f"{table}</table>\n{''.join(sections)}{config}</body></html>\n"
    )


# ----------------------------------------------------------------------------- command line


def add_report_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megatron-gspo report`."""
    parser.add_argument("run_dir", help="run directory (holding metrics.jsonl), or a metrics.jsonl file")
    parser.add_argument("--out", help="HTML file to write (default: RUN_DIR/report.html)")


def run_report(args: argparse.Namespace) -> int:
    """Entry point: read the metrics, write the page, print its path."""
    given = Path(args.run_dir)
    metrics = given if given.is_file() else given / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(
            f"report: {metrics} does not exist; give a run directory (trainer.run_dir) or its metrics.jsonl"
        )
    try:
        records = read_metrics(metrics)
    except ValueError as err:
        raise ConfigError(f"report: {metrics} is not JSON lines: {err}") from None
    if not records:
        raise ConfigError(f"report: {metrics} holds no records yet")
    config = metrics.parent / "config.yaml"
    out = Path(args.out) if args.out else metrics.parent / "report.html"
    page = render_html(
        records, f"megatron-gspo run {metrics.parent}", config.read_text() if config.is_file() else None
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    print(f"wrote {out} ({len(records)} steps of {metrics})")
    return 0
