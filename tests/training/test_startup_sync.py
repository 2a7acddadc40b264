"""What the embedded server starts from, and the one sync that follows when the weights changed.

A run from an HF checkpoint without SFT serves the checkpoint as it is (nothing exported, nothing
sent before step 1); with SFT the server still starts from the checkpoint and the trainer syncs
its SFT weights into it first. Either way step 1's train/inference mismatch is fp32 noise (~1e-7
nats): a server left on the pre-SFT weights would differ by O(0.1). (Without SFT the random
policy scores nothing, so step 1 skips its update and measures no mismatch.)
"""

import os
import subprocess
import sys

import pytest

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf_checkpoint import make_tiny_hf_checkpoint
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
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", "--config", str(config)]
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
