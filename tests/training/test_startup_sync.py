"""What the embedded server starts from, and the one sync that follows when the weights changed.

A run from an HF checkpoint without SFT serves the checkpoint as it is (nothing exported, nothing
sent before step 1); with SFT the server still starts from the checkpoint and the trainer syncs
its SFT weights into it first. Either way step 1's train/inference mismatch is fp32 noise (~1e-7
nats): a server left on the pre-SFT weights would differ by O(0.1). (Without SFT the random
policy scores nothing, so step 1 skips its update and measures no mismatch.)

An external server that does not serve the trainer's weights is synced at start-up: a run of no
steps (only the cold-start evaluation) leaves it on the trainer's weight version, and its prompt
log-probs are the checkpoint's (computed here from the checkpoint itself), not the other weights'.
"""

import os
import subprocess
import time

import httpx
import pytest
import torch
from warm_python import python

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.tasks.tokenizer import build_char_tokenizer
from megatron_gspo.training.metrics import read_metrics

pytestmark = pytest.mark.slow  # end-to-end training runs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "tiny"
    return make_tiny_hf_checkpoint(out, tiny(vocab_size=80), build_char_tokenizer())


@pytest.mark.parametrize("sft_steps", [0, 20])
def test_server_starts_from_the_checkpoint_and_gets_the_sft_weights(checkpoint, tmp_path, sft_steps):
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model: {{hf_path: {checkpoint}}}\n"
        "task: {name: addition, options: {min_digits: 1, max_digits: 2, format_reward: 0.5}}\n"
        f"sft: {{steps: {sft_steps}}}\n"
        "rollout: {rollout_batch_size: 4, group_size: 4, max_new_tokens: 4, temperature: 1.0}\n"
        "algorithm: {num_mini_batches: 1}\n"
        "eval: {at_start: false, at_end: false, every: 0}\n"
        f"trainer: {{steps: 1, run_dir: {run_dir}}}\n"
        "logging: {progress_bar: false}\n"
    )
    cmd = [*python(), "-m", "megatron_gspo.cli", "train", "--config", str(config)]
    done = subprocess.run(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"serving {checkpoint}" in done.stderr
    startup_sync = "start-up: syncing" in done.stderr
    assert startup_sync == (sft_steps > 0)
    assert (sft_steps == 0) == ("start-up: the servers already serve" in done.stderr)
    if sft_steps:  # step 1 trains (the SFT policy scores), so its mismatch is measured
        step1 = read_metrics(run_dir / "metrics.jsonl")[-1]
        print(f"sft={sft_steps}: step-1 mismatch mean {step1['rollout/logprob_mismatch_mean']:.2e}")
        assert step1["train/all_zero_adv_batch"] == 0
        assert step1["rollout/logprob_mismatch_mean"] < 1e-6


@pytest.fixture
def external_server(checkpoint):
    """`megatron-gspo serve` on the checkpoint, started as a user would (no --weight-version)."""
    cmd = [*python(), "-m", "megatron_gspo.cli", "serve", "--model", str(checkpoint), "--port", "0"]
    server = subprocess.Popen(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, text=True
    )
    try:
        line = server.stdout.readline()
        assert "listening on " in line, line
        yield line.split("listening on ")[1].strip()
    finally:
        server.terminate()
        server.wait(timeout=60)


def _train_against(url, checkpoint, tmp_path, sft_steps=0):
    """A run of no steps: start-up (and its sync), the cold-start evaluation, nothing sent after."""
    cmd = [*python(), "-m", "megatron_gspo.cli", "train", "--config", str(tmp_path / "run.yaml")]
    (tmp_path / "run.yaml").write_text(
        f"model: {{hf_path: {checkpoint}}}\n"
        "task: {name: addition, options: {min_digits: 1, max_digits: 2}}\n"
        f"sft: {{steps: {sft_steps}, target_accuracy: null}}\n"
        f"rollout: {{rollout_batch_size: 2, group_size: 2, max_new_tokens: 4, server_urls: [{url}]}}\n"
        "algorithm: {num_mini_batches: 1}\n"
        "eval: {at_start: true, at_end: false, every: 0, num_problems: 4}\n"
        f"trainer: {{steps: 0, run_dir: {tmp_path / 'run'}}}\n"
        "logging: {progress_bar: false}\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


PROMPT = list(range(3, 40))  # token ids of the character tokenizer


def served_logprobs(url: str) -> torch.Tensor:
    """The server's log-probs of `PROMPT`'s tokens after the first ([len - 1])."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    out = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    return torch.tensor([lp for lp, _token, _text in out["meta_info"]["input_token_logprobs"][1:]])


def checkpoint_logprobs(path) -> torch.Tensor:
    """`PROMPT`'s log-probs under the HF checkpoint at `path`, computed here (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]


def served_version(url: str) -> str:
    return httpx.get(f"{url}/model_info", timeout=60).json()["weight_version"]  # the live one


def test_external_server_of_another_version_is_synced_before_the_cold_start_eval(
    checkpoint, external_server, tmp_path
):
    assert served_version(external_server) == "default"
    done = _train_against(external_server, checkpoint, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    said = f"start-up: {external_server} serves weight_version 'default', the trainer's is 0: syncing"
    assert said in done.stderr
    assert done.stderr.index(said) < done.stderr.index("cold-start held-out accuracy")
    assert served_version(external_server) == "0"  # synced, not only warned about
    torch.testing.assert_close(served_logprobs(external_server), checkpoint_logprobs(checkpoint))


def test_a_server_off_the_start_weights_is_named_when_a_sync_is_due_anyway(
    checkpoint, external_server, tmp_path
):
    """After SFT every server is synced; the one that did not serve the start weights is still named."""
    done = _train_against(external_server, checkpoint, tmp_path, sft_steps=2)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"start-up: {external_server} serves weight_version 'default', the trainer's is 0" in done.stderr
    assert served_version(external_server) == "0"


def test_external_server_on_other_weights_is_synced(checkpoint, external_server, tmp_path):
    other = make_tiny_hf_checkpoint(tmp_path / "other", tiny(vocab_size=80), build_char_tokenizer(), seed=1)
    # an earlier run left the server on its weights, at version "0"
    body = {"model_path": str(other), "weight_version": "0"}
    assert httpx.post(f"{external_server}/update_weights_from_disk", json=body, timeout=120).json()["success"]
    stale = served_logprobs(external_server)
    want = checkpoint_logprobs(checkpoint)
    assert (stale - want).abs().max() > 0.1  # the other weights show in the log-probs
    done = _train_against(external_server, checkpoint, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"start-up: {external_server} serves {other}, not {checkpoint}: syncing" in done.stderr
    assert served_version(external_server) == "0"
    torch.testing.assert_close(served_logprobs(external_server), want)  # the trainer's weights, served


def test_external_server_lost_mid_run_is_one_line(checkpoint, tmp_path):
    cmd = [*python(), "-m", "megatron_gspo.cli", "serve", "--model", str(checkpoint), "--port", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().split("listening on ")[1].strip()
        (tmp_path / "run.yaml").write_text(
            f"model: {{hf_path: {checkpoint}}}\n"
            "task: {name: addition, options: {min_digits: 1, max_digits: 2}}\n"
            "sft: {steps: 0}\n"
            f"rollout: {{rollout_batch_size: 2, group_size: 2, max_new_tokens: 4, server_urls: [{url}],\n"
            "          max_retries: 1, request_timeout_s: 10}\n"
            "algorithm: {num_mini_batches: 1}\n"
            "eval: {at_start: false, at_end: false, every: 0}\n"
            f"trainer: {{steps: 100000, run_dir: {tmp_path / 'run'}}}\n"
            "weight_sync: {method: disk, retries: 0, timeout_s: 10}\n"
            "logging: {progress_bar: false}\n"
        )
        cmd = [*python(), "-m", "megatron_gspo.cli", "train", "--config", str(tmp_path / "run.yaml")]
        trainer = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 240
        while not (tmp_path / "run" / "metrics.jsonl").is_file():
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.stderr.read()[-3000:]
            time.sleep(0.2)
        server.kill()  # the server is lost mid-run
        _, stderr = trainer.communicate(timeout=300)
    finally:
        server.kill()
        server.wait()
    assert trainer.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "megatron-gspo train: rollout server failed: " in stderr and url in stderr.splitlines()[-1]
