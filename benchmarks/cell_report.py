"""What the stability grid and the staleness sweep report alike: one cell = one variant in one setting.

`reproduce_report.assemble` sees each cell as a "variant"; these helpers turn its per-variant
entries into cell records (accuracies per seed, collapse) and render the shared tables, so
`stability_grid.py` and `staleness_sweep.py` keep only what their grids add.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any


def mean_or_none(values: list[float]) -> float | None:
    """The mean, or None of nothing."""
    return statistics.mean(values) if values else None


def fmt(value: float | None, digits: int = 3) -> str:
    """`digits` significant digits; '-' for a value never logged."""
    return "-" if value is None else f"{value:.{digits}g}"


def accuracy_text(cell: dict[str, Any], key: str = "final") -> str:
    """'0.812 ± 0.041' for the final accuracy (mean only for `best`), '(3/5)' when runs are missing."""
    if not cell["runs"]:
        return f"0/{cell['of']} runs"
    std = cell["final_std"] if key == "final" else None
    text = f"{cell[f'{key}_mean']:.3f}" + ("" if std is None else f" ± {std:.3f}")
    return text + ("" if cell["runs"] == cell["of"] else f" ({cell['runs']}/{cell['of']})")


def cell_accuracies(report: dict[str, Any], name: str) -> dict[str, Any]:
    """Runs, cold start, final / best accuracy (mean, std, per seed) and collapse of cell `name`."""
    v = report["variants"][name]
    rows = [r for r in report["runs"] if r["variant"] == name and r["status"] != "failed"]
    return {
        "cell": name,
        "runs": v["runs"],
        "of": v["of"],
        "cold_start": v.get("cold_start"),
        "final_mean": v.get("final_mean"),
        "final_std": v.get("final_std"),
        "best_mean": v.get("best_mean"),
        "finals": {r["seed"]: r["final"] for r in rows},
        "bests": {r["seed"]: r["best"] for r in rows},
        "collapsed": v.get("collapsed"),
        "judged": v.get("judged"),
    }


def every_cell_table(cells: list[dict[str, Any]], columns: list[tuple[str, str | None]]) -> list[str]:
    """One row per cell; a column is (label, cell key), key None for 'final' and 'collapsed'."""
    lines = [
        "| cell | runs | " + " | ".join(label for label, _ in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for c in cells:
        values = []
        for label, key in columns:
            if key is None:
                values.append(accuracy_text(c) if label == "final" else f"{c['collapsed']}/{c['judged']}")
            else:
                values.append(fmt(c[key]))
        lines.append(f"| {c['cell']} | {c['runs']}/{c['of']} | " + " | ".join(values) + " |")
    return lines


def write_report(
    report: dict[str, Any],
    out: Path,
    markdown: Callable[[dict], str],
    plot: Callable[[dict, Path], None],
    png: str,
) -> list[str]:
    """summary.json, summary.md and the figure `png` in `out`; returns the file names."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(report, indent=1))
    (out / "summary.md").write_text(markdown(report))
    plot(report, out / png)
    return ["summary.md", "summary.json", png]
