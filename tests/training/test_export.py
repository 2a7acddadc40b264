"""`megatron-gspo export`: a TP2 x EP2 training checkpoint -> HF, as a user runs it.

The round trip is checked against the global weights the saving run gathered itself: the
exported directory, imported with `load_hf_checkpoint` into a world-of-one model, holds exactly
those weights and gives exactly the log-probs of a model handed them through
`load_global_state_dict`.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from forked_torchrun import torchrun
from reshard_worker import VOCAB, fixed_batch
from warm_python import python

from megatron_gspo.checkpoint.source import hf_checkpoint_dir
from megatron_gspo.config import ConfigError
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.hf.convert import load_hf_checkpoint
from megatron_gspo.model.logprobs import sequence_logprobs
from megatron_gspo.model.sharding import gather_global_state_dict, load_global_state_dict

HERE = Path(__file__).parent
REPO = HERE.parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*python(), "-m", "megatron_gspo.cli", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint saved by a TP2 x EP2 run (4 workers) and the global weights it held."""
    tmp = tmp_path_factory.mktemp("tp2ep2")
    cmd = [*torchrun(4, HERE / "reshard_worker.py"), "save", "--root", str(tmp / "ckpt")]
    cmd += ["--out", str(tmp / "saved")]
    done = subprocess.run(
        [*cmd, "--tp", "2", "--ep", "2"], env=ENV, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    saved = torch.load(tmp / "saved.pt", weights_only=False)
    return tmp / "ckpt" / "step_00000002", saved["weights"]


@pytest.fixture(scope="module")
def world_of_one():
    init_distributed(ParallelConfig())
    yield
    destroy_distributed()


def _logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        return sequence_logprobs(model, fixed_batch())[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [("--ep", "2"), ("--pp", "2")], ids=["ep2", "pp2"])
def test_export_round_trip_from_tp2_ep2(checkpoint, world_of_one, tmp_path, layout):
    """Loaded at EP2, or as two pipeline stages, the export holds exactly the saved weights."""
    ckpt, weights = checkpoint
    out = tmp_path / "hf"
    done = run_cli("export", "--checkpoint", str(ckpt), "--out", str(out), *layout, "--nproc", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"exported step 2 of {ckpt} to {out}" in done.stdout
    names = sorted(p.name for p in out.iterdir())
    assert "config.json" in names and "tokenizer_config.json" in names
    assert any(name.endswith(".safetensors") for name in names)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == VOCAB

    cfg = tiny(vocab_size=VOCAB)
    imported = build_model(cfg, ParallelConfig()).eval()
    load_hf_checkpoint(imported, out)
    got = gather_global_state_dict(imported)
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in got)
    reference = build_model(cfg, ParallelConfig()).eval()
    load_global_state_dict(reference, weights)
    assert torch.equal(_logprobs(imported), _logprobs(reference))


@pytest.mark.multiprocess  # the checkpoint fixture runs 4 workers
def test_analysis_tools_take_a_training_checkpoint(checkpoint, tmp_path):
    ckpt, _ = checkpoint
    with hf_checkpoint_dir(ckpt, "--a") as hf:
        assert hf != ckpt and (hf / "config.json").is_file() and (hf / "tokenizer_config.json").is_file()
    assert not hf.exists()  # the temporary export is gone
    with hf_checkpoint_dir(ckpt.parent, "--a") as from_root:  # a checkpoint root: its newest step
        assert (from_root / "config.json").is_file()
    with pytest.raises(ConfigError, match="--a .*: not a checkpoint"), hf_checkpoint_dir(tmp_path, "--a"):
        pass


def _assert_user_error(done: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2 and one line naming the problem, last on stderr (library warnings may precede it)."""
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and lines[-1].startswith("megatron-gspo export: "), done.stderr
    assert sum(line.startswith("megatron-gspo") for line in lines) == 1, done.stderr
    for needle in needles:
        assert needle in lines[-1], done.stderr


def test_bad_checkpoint_path_is_one_named_line(tmp_path):
    missing = tmp_path / "nope"
    done = run_cli("export", "--checkpoint", str(missing), "--out", str(tmp_path / "hf"))
    _assert_user_error(done, f"--checkpoint {missing}: no such directory")


def test_export_takes_a_run_directory_not_an_hf_one(short_run, tmp_path):
    """A run directory exports its newest intact step (as serve/drift/mismatch resolve it)."""
    done = run_cli("export", "--checkpoint", str(short_run), "--out", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"exported step 4 of {short_run / 'checkpoints' / 'step_00000004'}" in done.stdout
    assert (tmp_path / "hf" / "config.json").is_file()
    again = run_cli("export", "--checkpoint", str(tmp_path / "hf"), "--out", str(tmp_path / "hf2"))
    _assert_user_error(again, "is already an HF checkpoint directory")


@pytest.mark.multiprocess  # the checkpoint fixture runs 4 workers
def test_pipeline_layout_that_does_not_split_the_layers_is_one_named_line(checkpoint, tmp_path):
    ckpt, _ = checkpoint
    done = run_cli(
        "export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"), "--pp", "3", "--nproc", "3"
    )
    _assert_user_error(done, "export layout PP=3 does not divide the model's 2 layers")
    assert not (tmp_path / "hf").exists()


@pytest.mark.multiprocess  # the checkpoint fixture runs 4 workers
def test_damaged_checkpoint_is_named_not_exported(checkpoint, tmp_path):
    ckpt, _ = checkpoint
    copy = tmp_path / "step_00000002"
    shutil.copytree(ckpt, copy)
    target = copy / "dist" / "__1_0.distcp"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    done = run_cli("export", "--checkpoint", str(copy), "--out", str(tmp_path / "hf"))
    _assert_user_error(done, "dist/__1_0.distcp is corrupt: its sha256 is")
    assert not (tmp_path / "hf").exists()
