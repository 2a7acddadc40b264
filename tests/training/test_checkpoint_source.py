"""One resolver for the checkpoint paths `serve`, `drift`, `mismatch` and `parity` take.

Tested on a real short run's directory (`short_run`): an HF directory, a training checkpoint, a
run directory and its checkpoint root, a damaged newest step, and paths that are none of these.
"""

import json
import logging
import os
import shutil
import subprocess

import pytest

from megatron_gspo.checkpoint.source import remove_dead_exports, resolve_checkpoint
from megatron_gspo.config import ConfigError
from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint

STEP_4, STEP_2 = "step_00000004", "step_00000002"


def test_every_kind_resolves(short_run, tmp_path):
    hf = make_tiny_hf_checkpoint(tmp_path / "hf", tiny(vocab_size=80))
    assert resolve_checkpoint(hf, "--model").kind == "hf"
    step = short_run / "checkpoints" / STEP_2
    assert (resolve_checkpoint(step, "--model").kind, resolve_checkpoint(step, "--model").path) == (
        "training",
        step,
    )
    for given in (short_run, short_run / "checkpoints"):  # a run directory and its checkpoint root
        source = resolve_checkpoint(given, "--a")
        assert (source.kind, source.path, source.given) == (
            "training",
            short_run / "checkpoints" / STEP_4,
            given,
        )


def test_the_newest_intact_step_is_info_a_skipped_damaged_one_a_warning(short_run, tmp_path, caplog):
    """The documented choice is no warning; skipping a damaged newer step is."""
    with caplog.at_level(logging.INFO, logger="megatron_gspo.checkpoint.source"):
        resolve_checkpoint(short_run, "--a")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", f"--a {short_run}: using its newest intact checkpoint {short_run / 'checkpoints' / STEP_4}")
    ]
    caplog.clear()
    run = shutil.copytree(short_run, tmp_path / "run")
    (run / "checkpoints" / STEP_4 / "trainer_state.pt").unlink()
    with caplog.at_level(logging.INFO, logger="megatron_gspo.checkpoint.source"):
        assert resolve_checkpoint(run, "--a").path == run / "checkpoints" / STEP_2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"using {STEP_2}, skipped damaged checkpoint(s): {STEP_4}: " in warnings[0]
    assert "trainer_state.pt" in warnings[0]
    meta = run / "checkpoints" / STEP_2 / "model" / "config.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "hidden_size": 1}))  # checksum now wrong
    with pytest.raises(
        ConfigError,
        match=r"^--a .*/run: no intact checkpoint under .*/checkpoints: step_00000004: .*; step_00000002: ",
    ):
        resolve_checkpoint(run, "--a")
    with pytest.raises(ConfigError, match=r"^--model .*step_00000002: damaged training checkpoint: "):
        resolve_checkpoint(run / "checkpoints" / STEP_2, "--model")


def test_paths_of_no_kind_are_one_named_error(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    cases = {
        tmp_path / "missing": "no such directory; give an HF checkpoint directory",
        tmp_path / "notes.txt": "is a file, not a directory",
        tmp_path / "run": "run directory without a checkpoint yet",
        tmp_path: "not a checkpoint (it holds notes.txt, run/); give an HF checkpoint directory",
    }
    for path, message in cases.items():
        with pytest.raises(ConfigError) as err:
            resolve_checkpoint(path, "--model")
        assert str(err.value).startswith(f"--model {path}: {message}") and "\n" not in str(err.value)


def test_exports_whose_owner_died_are_removed_and_no_other(tmp_path):
    """A `serve` killed by SIGKILL leaves its export; the next tool start removes it."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tmp_path / f"megatron-gspo-export-{gone.pid}-abc"
    live = tmp_path / f"megatron-gspo-export-{os.getpid()}-def"
    foreign = tmp_path / "megatron-gspo-export-xyz"  # no owner pid in the name: not ours to judge
    for directory in (dead, live, foreign):
        (directory / "hf").mkdir(parents=True)
    assert remove_dead_exports(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, foreign.name])
