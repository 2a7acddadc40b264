"""`benchmarks/reproduce.py`: the quick grid end to end, resume, failures, and the report's definitions."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from reproduce_runs import run_reproduce

REPO = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quick_grid_shares_the_cold_start_and_resume_skips_finished_runs(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    first = run_reproduce("--quick", "--out", str(out), "--work-dir", str(work))
    assert first.returncode == 0, first.stdout + first.stderr[-4000:]
    report = json.loads((out / "summary.json").read_text())
    assert (out / "reproduce.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "summary.md").read_text()
    assert "**collapsed**" in md and report["command"] in md
    assert list(report["variants"]) == ["gspo", "grpo_r3"]
    for name, variant in report["variants"].items():
        assert variant["runs"] == variant["of"] == 1, name
        assert variant["means"]["time/step_s"] > 0
        assert variant["curves"]["accuracy"][0][0] == 0
    (cold,) = report["cold_starts"]
    assert cold["status"] == "finished" and cold["sft_steps"] == 60
    # Every variant starts RL from the cold start's weights: the same step-0 held-out accuracy.
    assert cold["same_start"] and cold["variant_starts"] == [cold["accuracy"]] * 2
    assert [(r["variant"], r["status"], r["steps"]) for r in report["runs"]] == [
        ("gspo", "finished", 3),
        ("grpo_r3", "finished", 3),
    ]
    assert {r["clip_label"] for r in report["runs"]} == {"clipped sequences", "clipped tokens"}

    markers = sorted(work.rglob("done.json"))
    assert len(markers) == 3  # one cold start, two RL runs
    stamps = {p: (p.stat().st_mtime_ns, (p.parent / "train.log").stat().st_mtime_ns) for p in markers}
    again = run_reproduce("--quick", "--out", str(out), "--work-dir", str(work))
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stdout.count("reused (finished earlier)") == 3, again.stdout
    assert {p: (p.stat().st_mtime_ns, (p.parent / "train.log").stat().st_mtime_ns) for p in markers} == stamps
    rerun = json.loads((out / "summary.json").read_text())
    assert [r["status"] for r in rerun["runs"]] == ["reused", "reused"]
    assert rerun["variants"]["gspo"]["final_mean"] == report["variants"]["gspo"]["final_mean"]


def test_an_unfinished_run_is_restarted_clean_and_a_failure_is_reported(tmp_path):
    reproduce_mod = load("reproduce")
    run_dir = tmp_path / "run"
    cfg = reproduce_mod.compose(
        {"task.name": "no_such_task", "trainer.run_dir": str(run_dir)}
    )  # refused at once
    run_dir.mkdir()
    (run_dir / "stale.txt").write_text("left by an interrupted run")
    job = reproduce_mod.Job("gspo", 1, run_dir, cfg)
    outcome = reproduce_mod.run_jobs([job], workers=1)[job]
    assert outcome.status == "failed" and "exit status 2" in outcome.message
    assert not (run_dir / "stale.txt").exists() and not (run_dir / "done.json").exists()
    assert "no_such_task" in (run_dir / "train.log").read_text()


def test_every_variant_validates_and_bad_overrides_are_named():
    reproduce_mod = load("reproduce")
    for name, overrides in reproduce_mod.VARIANTS.items():  # gspo + r3 and sapo's own options included
        reproduce_mod.check_config(name, reproduce_mod.compose(reproduce_mod.HARNESS, overrides))
    assert reproduce_mod.parse_set(["optim.lr=5e-4", "trainer.steps=30"]) == {
        "optim.lr": 5e-4,
        "trainer.steps": 30,
    }
    with pytest.raises(ValueError, match="trainer.seed: set by the harness"):
        reproduce_mod.parse_set(["trainer.seed=3"])
    with pytest.raises(ValueError, match="expected section.key=value"):
        reproduce_mod.parse_set(["optim.lr"])
    with pytest.raises(ValueError, match="variant grpo: config error: .*clip_low"):
        reproduce_mod.check_config("grpo", reproduce_mod.compose(reproduce_mod.VARIANTS["grpo"], {
            "algorithm.loss_options": {"clip_low": -1.0}}))  # fmt: skip


def test_plan_gives_each_seed_one_cold_start_shared_by_its_variants(tmp_path):
    reproduce_mod = load("reproduce")
    jobs = reproduce_mod.plan(["gspo", "grpo_r2"], [1, 2], {"optim.lr": 5e-4}, tmp_path)
    colds = [j for j in jobs if j.variant is None]
    assert [j.seed for j in colds] == [1, 2] and jobs[:2] == colds
    for job in jobs[2:]:
        assert job.needs.seed == job.seed and job.config.model.hf_path == str(job.needs.run_dir / "hf")
        assert job.config.trainer.seed == job.config.sft.seed == job.seed and job.config.sft.steps == 0
        assert "overrides" not in job.config.model and job.config.optim.lr == 5e-4
    assert colds[0].config.trainer.steps == 0 and colds[0].config.sft.seed == 1
    # An RL-only override keeps the cold start (same directory); a model change does not.
    again = reproduce_mod.plan(["gspo"], [1], {"optim.lr": 1e-3}, tmp_path)
    assert again[0].run_dir == colds[0].run_dir and again[1].run_dir != jobs[2].run_dir
    other = reproduce_mod.plan(["gspo"], [1], {"model.overrides.num_layers": 4}, tmp_path)
    assert other[0].run_dir != colds[0].run_dir


def test_collapse_needs_the_reward_to_fall_below_half_and_stay_there():
    report = load("reproduce_report")
    assert report.collapse([0.6, 0.6, 0.6, 0.5, 0.2, 0.1, 0.1]) == {"collapsed": True, "step": 5}
    assert report.collapse([0.6, 0.6, 0.6, 0.1, 0.1, 0.1, 0.4]) == {"collapsed": False, "step": None}
    assert report.collapse([0.6, 0.6, 0.6, 0.6, 0.1, 0.1]) == {"collapsed": False, "step": None}  # 2 < K=3
    assert report.collapse([0.6, 0.2, 0.2, 0.2]) == {"collapsed": True, "step": 2}  # against step 1 alone
    assert report.collapse([0.6, 0.1, 0.1]) == {"collapsed": None, "step": None}  # too short to judge
    assert report.collapse([0.0] * 8) == {"collapsed": False, "step": None}  # nothing to fall from
    assert report.steps_to([(0, 0.5), (5, 0.55), (10, 0.62), (15, 0.7)], 0.6) == 10
    assert report.steps_to([(0, 0.7), (5, 0.55)], 0.6) is None  # the cold start itself does not count
