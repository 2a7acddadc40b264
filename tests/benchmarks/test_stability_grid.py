"""`benchmarks/reproduce.py --grid`: cells, their configs, the report's figures, the quick grid end to end."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def modules():
    spec = importlib.util.spec_from_file_location("reproduce", REPO / "benchmarks" / "reproduce.py")
    reproduce = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = reproduce  # dataclasses look their module up
    spec.loader.exec_module(reproduce)  # puts benchmarks/ on sys.path and imports the grid and report modules
    return reproduce, sys.modules["stability_grid"], sys.modules["reproduce_report"]


def test_the_grid_is_every_variant_at_every_n_plus_the_stale_and_reference_cells_and_each_validates(modules):
    reproduce, grid_mod, _ = modules
    grid = grid_mod.cells(list(grid_mod.GRID_VARIANTS), [1, 4, 8, 16], ["gspo", "grpo_tis_r2"], 4, ["grpo"])
    assert len(grid) == 6 * 4 + 2 + 1 and len({c.name for c in grid}) == len(grid)
    assert [c.name for c in grid[-3:]] == ["gspo@N4+stale2", "grpo_tis_r2@N4+stale2", "grpo@N1+bf16rollouts"]
    # As the trainer will load each: the grid's FP8 rollouts (bf16 for the references), bf16 trainer.
    for cell in grid:
        cfg = reproduce.compose(reproduce.HARNESS, grid_mod.GRID_SETS, cell.overrides())
        reproduce.check_config(cell.name, cfg)
        assert cfg.algorithm.num_mini_batches == cell.updates and cfg.algorithm.ppo_epochs == 1
        assert (
            cfg.rollout.quantization == ("none" if cell.bf16_rollouts else "fp8")
            and cfg.engine.dtype == "bf16"
        )
    tis = grid_mod.Cell("grpo_tis", 8).overrides()
    assert tis["algorithm.old_logprobs"] == "recompute"
    assert tis["algorithm.rollout_correction"] == {"method": "tis", "level": "token", "cap": 2.0}
    assert grid_mod.Cell("grpo", 1).overrides()["algorithm.old_logprobs"] == "recompute"
    assert "algorithm.rollout_correction" not in grid_mod.Cell("grpo", 1).overrides()
    # A stale R3 cell is a valid config too (R3 replays the sampling weights' routes).
    stale_r3 = grid_mod.Cell("grpo_tis_r3", 4, 2)
    cfg = reproduce.compose(reproduce.HARNESS, grid_mod.GRID_SETS, stale_r3.overrides())
    reproduce.check_config(stale_r3.name, cfg)
    assert cfg.rollout.max_staleness == 2 and cfg.algorithm.routing_replay == "r3"


def test_grid_arguments_are_checked(modules, capsys):
    reproduce, _, _ = modules
    for argv, message in [
        (["--grid", "--set", "algorithm.num_mini_batches=2"], "set per cell by --grid"),
        (["--grid", "--variants", "sapo"], "unknown variant 'sapo'"),
        (["--updates", "4"], "belong to --grid"),
        (["--reference-variants", "grpo"], "belong to --grid"),
        (["--grid", "--reference-variants", "sapo"], "unknown variant 'sapo'"),
        (["--grid", "--updates", "0"], "N must be >= 1"),
    ]:
        with pytest.raises(SystemExit):
            reproduce.main(argv)
        assert message in capsys.readouterr().err, argv


def _run(report_mod, cell: str, seed: int, accuracies: list[float], mb: dict[int, float]):
    records = [{"step": 0, "eval/accuracy": accuracies[0]}]
    for step in (1, 2, 3, 4):
        record = {
            "step": step,
            "rollout/reward_mean": 0.5,
            "rollout/k3_kl": 0.01 * step,
            "actor/clipfrac_tokens": 0.1,
        }
        record.update({f"drift/old_new_mb{m}/mean": value * step for m, value in mb.items()})
        records.append(record)
    records[-1]["eval/accuracy"] = accuracies[1]
    records[2]["eval/accuracy"] = accuracies[2]
    return report_mod.Run(cell, seed, "grpo", "finished", f"runs/{cell}/train.log", records)


def test_grid_report_figures_against_hand_computed_values(modules, tmp_path):
    _, grid_mod, report_mod = modules
    grid = grid_mod.cells(["grpo_tis"], [1, 4], [], 4, ["grpo_tis"])
    runs = [
        _run(report_mod, "grpo_tis@N1+bf16rollouts", 1, [0.6, 0.9, 0.95], {0: 0.0}),
        _run(report_mod, "grpo_tis@N1", 1, [0.6, 0.7, 0.8], {0: 0.0}),
        _run(report_mod, "grpo_tis@N1", 2, [0.5, 0.3, 0.4], {0: 0.0}),
        _run(report_mod, "grpo_tis@N4", 1, [0.6, 0.2, 0.65], {0: 0.0, 1: 0.01, 2: 0.02, 3: 0.03}),
    ]
    colds = [report_mod.ColdStart(1, "finished", "c1", [{"step": 0, "eval/accuracy": 0.6}])]
    provenance = {"command": "python benchmarks/reproduce.py --grid", "base_config": "b", "overrides": [],
                  "variant_overrides": {c.name: [] for c in grid}, "seeds": [1, 2], "jobs": 1,
                  "wall_seconds": 1.0, "machine": {}}  # fmt: skip
    report = report_mod.assemble(
        runs, colds, [c.name for c in grid], target=None, gain=0.1, provenance=provenance
    )
    files = grid_mod.write(report, runs, grid, tmp_path)
    assert files == ["summary.md", "summary.json", "stability_grid.png"]
    written = json.loads((tmp_path / "summary.json").read_text())["grid"]
    n1, n4, reference = written["cells"]
    assert (n1["updates"], n4["updates"], written["updates"]) == (1, 4, [1, 4])
    assert (
        reference["bf16_rollouts"]
        and not n1["bf16_rollouts"]
        and reference["final_mean"] == pytest.approx(0.9)
    )
    assert n1["final_mean"] == pytest.approx(0.5) and n1["final_std"] == pytest.approx(
        0.08**0.5
    )  # sample std of 0.7, 0.3
    assert n1["finals"] == {"1": 0.7, "2": 0.3} and n1["best_mean"] == pytest.approx((0.8 + 0.4) / 2)
    assert n1["k3_kl"] == pytest.approx(0.025)  # steps 1..4: 0.01 x (1 + 2 + 3 + 4) / 4
    # N = 1: nothing updates before its only mini-batch, so no old->new drift is reported.
    assert n1["drift_1_update"] is None and n1["drift_last_update"] is None
    assert n4["drift_1_update"] == pytest.approx(0.025) and n4["drift_last_update"] == pytest.approx(0.075)
    assert n4["drift_mean_1_to_last"] is None  # not logged by these records
    md = (tmp_path / "summary.md").read_text()
    assert "| grpo_tis | 0.500 ± 0.283 | 0.200 (1/1) |" not in md  # a full cell has no (k/n)
    # The reference cell (same variant and N, bf16 rollouts): out of the FP8 tables, in the every-cell one.
    assert "| grpo_tis | 0.500 ± 0.283 | 0.200 |" in md and "## Details" in md
    assert "| grpo_tis@N1+bf16rollouts | 1/1 | 0.600 | 0.900 |" in md
    assert (tmp_path / "stability_grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quick_grid_runs_fp8_cells_at_two_n_and_a_stale_cell(quick_report):
    report, out = quick_report("--grid")
    cells = {c["cell"]: c for c in report["grid"]["cells"]}
    assert list(cells) == ["grpo_tis@N1", "grpo_tis@N2", "gspo@N2+stale2"]
    assert all(c["runs"] == c["of"] == 1 for c in cells.values())
    assert (
        cells["grpo_tis@N1"]["drift_1_update"] is None and cells["grpo_tis@N2"]["drift_1_update"] is not None
    )
    assert all(c["k3_kl"] > 0 for c in cells.values())  # FP8 rollouts against the bf16 trainer
    assert cells["gspo@N2+stale2"]["staleness_mean"] is not None
    assert 'rollout.quantization="fp8"' in " ".join(report["overrides"])
    (cold,) = report["cold_starts"]
    assert cold["same_start"]
    assert (out / "stability_grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_only_runs_nothing_and_lists_what_has_not_finished(modules, tmp_path, capsys):
    reproduce, _, _ = modules
    out, work = tmp_path / "out", tmp_path / "work"
    assert (
        reproduce.main(["--grid", "--quick", "--report-only", "--out", str(out), "--work-dir", str(work)])
        == 1
    )
    assert not work.exists()  # no run was started (a started one makes its directory)
    assert "4 of 4 runs not finished yet" in capsys.readouterr().out  # 1 cold start + 3 cells
    report = json.loads((out / "summary.json").read_text())
    assert [c["runs"] for c in report["grid"]["cells"]] == [0, 0, 0]
    assert {r["message"] for r in report["runs"]} == {reproduce.NOT_RUN}
    assert "0/1 runs" in (out / "summary.md").read_text()
