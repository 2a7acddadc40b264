"""`megatron-gspo serve --model` takes every kind of checkpoint path, and names a bad one.

A training checkpoint of a real short run (`short_run`) is served: the log-probs the server
returns for its own samples equal those of the Megatron policy loaded from that checkpoint's
`dist/` files (no HF export on the reference side), and SIGTERM removes the temporary export.
"""

import os
import signal
import subprocess
import time

import httpx
import torch
from warm_python import python

from megatron_gspo.checkpoint.load import load_weights
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.hf.convert import read_hf_config
from megatron_gspo.model.logprobs import sequence_logprobs

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def serve(model, tmp_path) -> subprocess.Popen:
    cmd = [*python(), "-m", "megatron_gspo.cli", "serve", "--model", str(model), "--port", "0"]
    env = {**ENV, "TMPDIR": str(tmp_path)}  # where a training checkpoint's export goes
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def megatron_logprobs(step_dir, tokens: list[int]) -> torch.Tensor:
    init_distributed(ParallelConfig())
    try:
        model = build_model(read_hf_config(step_dir / "model"), ParallelConfig()).eval()
        load_weights(step_dir, model)
        with torch.no_grad():
            return sequence_logprobs(model, [torch.tensor(tokens)])[0][0]
    finally:
        destroy_distributed()


def test_serve_takes_a_training_checkpoint(short_run, tmp_path):
    step_dir = short_run / "checkpoints" / "step_00000004"
    server = serve(step_dir, tmp_path)
    try:
        line = server.stdout.readline()
        assert "listening on http://" in line, line + server.stderr.read()[-3000:]
        url = line.split("listening on ")[1].strip()
        assert len(list(tmp_path.glob("megatron-gspo-export-*/hf/*.safetensors"))) == 1
        prompt = [1, 5, 16, 4]  # BOS "2+1" in the demo's character vocabulary
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 7},
            "return_logprob": True,
        }
        meta = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
    finally:
        server.terminate()
        server.wait(60)
    assert not list(tmp_path.glob("megatron-gspo-export-*"))  # SIGTERM removed the temporary export
    tokens = [t for _, t, _ in meta["output_token_logprobs"]]
    served = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]], dtype=torch.float64)
    reference = megatron_logprobs(step_dir, prompt + tokens)[len(prompt) :].double()
    assert torch.allclose(served, reference, atol=1e-4), (served, reference)


def test_sigterm_during_the_export_removes_it(short_run, tmp_path):
    """Killed before it serves, `serve` removed nothing: its export stayed in the temp dir."""
    server = serve(short_run / "checkpoints" / "step_00000004", tmp_path)
    try:
        while not list(tmp_path.glob("megatron-gspo-export-*")):  # the export has begun
            assert server.poll() is None, server.stderr.read()[-3000:]
            time.sleep(0.01)
        server.terminate()
        _, err = server.communicate(timeout=60)
    finally:
        server.kill()
    assert server.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not list(tmp_path.glob("megatron-gspo-export-*"))


def test_serve_a_missing_path_is_one_named_line(tmp_path):
    missing = tmp_path / "nonexistent"
    done = subprocess.run(
        [*python(), "-m", "megatron_gspo.cli", "serve", "--model", str(missing)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"megatron-gspo serve: --model {missing}: no such directory; give an HF checkpoint directory "
        "(config.json + *.safetensors), a training checkpoint (RUN/checkpoints/step_NNNNNNNN) or a run "
        "directory (RUN: its newest intact checkpoint)"
    ]
