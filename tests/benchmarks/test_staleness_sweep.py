"""`benchmarks/reproduce.py --staleness`: cells, configs, the report's figures, the quick sweep end to end."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def modules():
    spec = importlib.util.spec_from_file_location("reproduce", REPO / "benchmarks" / "reproduce.py")
    reproduce = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = reproduce  # dataclasses look their module up
    spec.loader.exec_module(reproduce)  # puts benchmarks/ on sys.path, imports the sweep and report modules
    return reproduce, sys.modules["staleness_sweep"], sys.modules["reproduce_report"]


def test_every_variant_at_every_k_validates_with_its_bound_and_drain(modules, tmp_path):
    reproduce, sweep_mod, _ = modules
    cells = sweep_mod.cells(sweep_mod.VARIANTS, sweep_mod.STALENESS)
    assert [c.name for c in cells[:3]] == ["gspo@k0", "gspo@k2", "gspo@k4"] and len(cells) == 12
    specs = {c.name: c.overrides(reproduce.VARIANTS) for c in cells}
    jobs = reproduce.plan(list(specs), [1], dict(sweep_mod.SWEEP_SETS), tmp_path, specs)  # validates each
    (cold,) = [j for j in jobs if j.variant is None]
    for job in jobs[1:]:  # one cold start for every cell of the seed
        cell = next(c for c in cells if c.name == job.variant)
        assert job.needs is cold and job.config.rollout.max_staleness == cell.staleness
        assert job.config.rollout.update_mode == "drain" and job.config.drift.enabled
        replay = OmegaConf.select(job.config, "algorithm.routing_replay", default=None)
        assert replay == {"grpo_r2": "r2", "grpo_r3": "r3"}.get(cell.variant)


def test_sweep_arguments_are_checked(modules, capsys):
    reproduce, _, _ = modules
    for argv, message in [
        (["--staleness", "2", "--set", "rollout.max_staleness=1"], "set per cell by --staleness"),
        (["--staleness", "-1"], "K must be >= 0"),
        (["--staleness", "--grid"], "choose one"),
        (["--staleness", "--variants", "grpo_tis"], "unknown variant 'grpo_tis'"),
    ]:
        with pytest.raises(SystemExit):
            reproduce.main(argv)
        assert message in capsys.readouterr().err, argv


def _run(report_mod, cell: str, seed: int, accuracies: list[float], drift: float, stale: float):
    records = [{"step": 0, "eval/accuracy": accuracies[0]}]
    for step in (1, 2, 3, 4):
        records.append(
            {
                "step": step,
                "rollout/reward_mean": 0.5,
                "rollout/staleness_mean": stale * (step > 1),  # the first batch comes from version 0
                "rollout/stale_groups_dropped": float(step == 3),
                "drift/infer_train/mean": drift * step,
                "actor/clipfrac_tokens": 0.1,
            }
        )
    records[-1]["eval/accuracy"] = accuracies[1]
    records[2]["eval/accuracy"] = accuracies[2]
    return report_mod.Run(cell, seed, "grpo", "finished", f"runs/{cell}/train.log", records)


def test_sweep_report_figures_against_hand_computed_values(modules, tmp_path):
    _, sweep_mod, report_mod = modules
    cells = sweep_mod.cells(["grpo"], [0, 2])
    runs = [
        _run(report_mod, "grpo@k0", 1, [0.6, 0.7, 0.8], 0.01, 0.0),
        _run(report_mod, "grpo@k0", 2, [0.5, 0.3, 0.4], 0.03, 0.0),
        _run(report_mod, "grpo@k2", 1, [0.6, 0.65, 0.7], 0.1, 2.0),
    ]
    colds = [report_mod.ColdStart(1, "finished", "c1", [{"step": 0, "eval/accuracy": 0.6}])]
    provenance = {"command": "python benchmarks/reproduce.py --staleness 0 2", "base_config": "b",
                  "overrides": [], "variant_overrides": {c.name: [] for c in cells}, "seeds": [1, 2],
                  "jobs": 1, "wall_seconds": 1.0, "machine": {}}  # fmt: skip
    report = report_mod.assemble(
        runs, colds, [c.name for c in cells], target=None, gain=0.1, provenance=provenance
    )
    written = sweep_mod.write(report, runs, cells, tmp_path)
    assert written == ["summary.md", "summary.json", "staleness_sweep.png"]
    k0, k2 = json.loads((tmp_path / "summary.json").read_text())["sweep"]["cells"]
    assert (k0["staleness"], k2["staleness"]) == (0, 2)
    assert k0["final_mean"] == pytest.approx(0.5) and k0["finals"] == {"1": 0.7, "2": 0.3}
    # Drift: steps 1..4 of d x step average 2.5 d; seeds 0.025 and 0.075 average 0.05.
    assert k0["behaviour_current"] == pytest.approx(0.05)
    assert k0["behaviour_current_per_seed"] == {"1": pytest.approx(0.025), "2": pytest.approx(0.075)}
    assert k2["behaviour_current"] == pytest.approx(0.25)
    assert k2["staleness_mean"] == pytest.approx(1.5)  # 0, 2, 2, 2
    assert k0["stale_groups_dropped"] == 1 and k0["clipped_tokens"] == pytest.approx(0.1)
    assert k0["old_new_1_update"] is None  # not logged by these records
    md = (tmp_path / "summary.md").read_text()
    assert "| grpo | 0.05 | 0.25 |" in md  # the drift-vs-k table
    assert "| grpo | 0.500 ± 0.283 | 0.650 |" in md and "## Details" in md
    assert (tmp_path / "staleness_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quick_sweep_runs_one_variant_at_k0_and_k2_from_one_cold_start(quick_report):
    report, out = quick_report("--staleness")
    k0, k2 = report["sweep"]["cells"]
    assert (k0["cell"], k2["cell"]) == ("grpo_r3@k0", "grpo_r3@k2")
    assert k0["runs"] == k0["of"] == k2["runs"] == k2["of"] == 1
    assert k0["staleness_mean"] is None and k0["stale_groups_dropped"] is None  # lock-step: not logged
    assert 0 < k2["staleness_mean"] <= 2 and k2["stale_groups_dropped"] == 0
    assert k0["behaviour_current"] is not None and k2["behaviour_current"] is not None
    assert 'rollout.update_mode="drain"' in " ".join(report["overrides"])
    (cold,) = report["cold_starts"]
    assert cold["same_start"]
    assert (out / "staleness_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
