"""A colocated run (torchrun, 2 trainer ranks, its embedded server launched with the memory saver
on the same devices, weights by tensor handles) against the disaggregated run of the same config.

Each step the servers release their KV cache and weights, the trainer onloads, trains, offloads,
the servers resume and take the weights: none of it may change a number. After 3 steps the
checkpoints (model and optimizer state) and every metric but timings are equal bit for bit (fp32).
The servers' side (release, refusal while released, tensor handles) is tested in tests/rollout.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from warm_python import python

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint

CONFIG = """
model: {{hf_path: {hf}}}
task: {{name: addition, options: {{min_digits: 1, max_digits: 2, format_reward: 0.5}}}}
sft: {{steps: 20, lr: 3.0e-3, batch_size: 32}}
rollout: {{group_size: 4, rollout_batch_size: 8, max_new_tokens: 4}}
algorithm: {{loss_type: gspo, num_mini_batches: 2}}
optim: {{lr: 5.0e-4}}
trainer: {{steps: 3, micro_batch_size: 2}}
eval: {{num_problems: 8}}
logging: {{progress_bar: false, tensorboard: false}}
"""
TIMING = ("time/", "perf/", "sync/", "colocate/", "memory/")


def train(config: Path, run_dir: Path, *extra: str) -> list[dict]:
    cmd = [*python(), "-m", "megatron_gspo.cli", "train", "--config", str(config),
           f"trainer.run_dir={run_dir}", "--nproc", "2", *extra]  # fmt: skip
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def checkpoint_tensors(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Every tensor of the run's step checkpoint (model and optimizer state), by name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = run_dir / "whole.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step_{step:08d}" / "dist", whole)

    def flat(tree, prefix=""):
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}/"))
            elif isinstance(value, torch.Tensor):
                out[f"{prefix}{key}"] = value
        return out

    return flat(torch.load(whole, weights_only=False))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_colocated_run_equals_the_disaggregated_run_bit_for_bit(tmp_path):
    hf = make_tiny_hf_checkpoint(tmp_path / "init", tiny(vocab_size=80), seed=5)
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.format(hf=hf))
    # One server of TP 2 over the two devices: the embedded server batches a step's rows as the
    # disaggregated run's single server does (its fp32 log-probs depend on the batch's make-up).
    colocate = [
        "rollout.placement=colocated",
        "weight_sync.method=tensor",
        "rollout.server_tensor_parallel=2",
    ]
    colocated = train(config, tmp_path / "colocated", *colocate)
    disaggregated = train(config, tmp_path / "disaggregated")  # default: distributed weight sync
    assert [r["step"] for r in colocated] == [r["step"] for r in disaggregated] == [0, 1, 2, 3]
    for c, d in zip(colocated, disaggregated):
        if c["step"]:
            assert c["colocate/release_s"] >= 0 and c["colocate/offload_bytes"] == 0.0  # CPU: nothing moves
            assert c["train/all_zero_adv_batch"] == 0.0  # a step that trains
        assert "colocate/release_s" not in d
        same = {k: v for k, v in d.items() if not k.startswith(TIMING) and not k.endswith("seconds")}
        assert {k: c[k] for k in same} == same, c["step"]
    ours, theirs = (
        checkpoint_tensors(tmp_path / "colocated", 3),
        checkpoint_tensors(tmp_path / "disaggregated", 3),
    )
    assert ours.keys() == theirs.keys() and len(ours) > 10
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
