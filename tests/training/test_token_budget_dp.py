"""Token-budget micro-batches over 2 data-parallel (expert-parallel) gloo ranks: the update is
the one of strided count-based micro-batches and of the whole batch in a world of one."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from budget_worker import make_batch, update, weights
from forked_torchrun import torchrun
from rl_update_common import MODEL, build_policy

from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.training.step.micro_batches import DataLayout

WORKER = Path(__file__).with_name("budget_worker.py")


def world_of_one_update(hf):
    """The reference: the whole batch, one micro-batch per mini-batch, one process."""
    init_distributed(ParallelConfig(), seed=3)
    try:
        model = build_policy(ParallelConfig(), hf)
        batch, advantages = make_batch()
        metrics, _ = update(model, batch, advantages, DataLayout.from_megatron(0, 1))
        return metrics, {k: v for k, v in weights(model).items() if "experts" not in k}
    finally:
        destroy_distributed()


@pytest.mark.multiprocess
def test_token_budget_update_matches_count_and_world_of_one(tmp_path):
    hf = make_tiny_hf_checkpoint(tmp_path / "hf", MODEL, seed=5)
    cmd = [*torchrun(2, WORKER), f"--hf={hf}", f"--result={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    budget_sizes = [r["budget"]["micro_batch_sizes"] for r in ranks]
    for m in range(2):
        assert len(budget_sizes[0][m]) == len(budget_sizes[1][m])  # equal micro-batch counts per mini-batch
    assert any(sum(budget_sizes[0][m]) != sum(budget_sizes[1][m]) for m in range(2))  # balanced by tokens
    assert all(len(sizes) > 1 for sizes in budget_sizes[0])  # several micro-batches
    assert [r["count"]["micro_batch_sizes"] for r in ranks] == [[[4], [4]]] * 2  # strided, whole

    for r in ranks:
        assert r["moved"] > 1e-2 and r["count_vs_budget"] < 1e-6  # each rank's shard, experts included
    count, budget = ranks[0]["count"]["metrics"], ranks[0]["budget"]["metrics"]
    for key in ("actor/pg_loss", "train/grad_norm"):
        assert budget[key] == pytest.approx(count[key], rel=1e-5, abs=1e-7), key
    assert budget["perf/dp_token_imbalance"] < count["perf/dp_token_imbalance"]

    reference, dense = world_of_one_update(hf)
    for key in ("actor/pg_loss", "train/grad_norm"):
        assert budget[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), key
    got = torch.load(tmp_path / "dense.pt")
    assert got.keys() == dense.keys()
    for k in dense:
        torch.testing.assert_close(got[k], dense[k], rtol=1e-5, atol=1e-6)
