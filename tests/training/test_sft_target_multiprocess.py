"""The cold start's accuracy checks under torchrun (EP2: DP over 2 ranks; TP2: vocab-parallel logits)
agree with a world of one and with the rollout server's own held-out evaluation."""

import os
import subprocess
from pathlib import Path

import pytest
from warm_python import python

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.training.metrics import read_metrics

# 21 problems: the DP ranks decode 11 and 10, so their packed shapes and finishing steps differ.
CONFIG = """
model: {{hf_path: {hf}}}
task: {{name: sort_digits, options: {{min_length: 1, max_length: 3}}}}
sft: {{steps: 25, target_accuracy: 1.0, check_every: 10, lr: 3.0e-3, batch_size: 32}}
rollout: {{group_size: 4, rollout_batch_size: 8, max_new_tokens: 4}}
algorithm: {{num_mini_batches: 2}}
trainer: {{steps: 0}}
eval: {{num_problems: 21}}
logging: {{progress_bar: false, tensorboard: false}}
"""


def cold_start(config, run_dir, *extra):
    cmd = [*python(), "-m", "megatron_gspo.cli", "train", "--config", str(config),
           f"trainer.run_dir={run_dir}", *extra]  # fmt: skip
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    (record,) = read_metrics(Path(run_dir, "metrics.jsonl"))
    return record


@pytest.mark.multiprocess
@pytest.mark.slow
def test_accuracy_checks_agree_across_layouts_and_with_the_server(tmp_path):
    hf = make_tiny_hf_checkpoint(tmp_path / "init", tiny(vocab_size=80), seed=5)
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.format(hf=hf))
    single = cold_start(config, tmp_path / "world1")
    assert single["sft/steps"] == 25 and single["sft/hit_cap"] == 1.0
    assert 0 < single["sft/accuracy"] < 1  # a policy with some right and some wrong answers
    # Same weights, same problems: the trainer's greedy decoding agrees with the server's.
    assert single["sft/accuracy"] == single["eval/accuracy"]
    for layout in (["parallel.expert_parallel=2"], ["parallel.tensor_parallel=2"]):
        other = cold_start(config, tmp_path / layout[0].split("=")[0], *layout, "--nproc", "2")
        assert other["sft/accuracy"] == single["sft/accuracy"], layout
        assert other["eval/accuracy"] == other["sft/accuracy"], layout
