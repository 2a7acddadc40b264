"""Per-rank scatter of the rollout rows: row selection, encoding, and the real 4-process transport."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from forked_torchrun import torchrun
from scatter_worker import LAYOUTS, MINI, make_batch

from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.training.step.micro_batches import DataLayout, dp_rows
from megatron_gspo.training.step.scatter import RankRows
from megatron_gspo.training.step.update import plan_mini_batches

WORKER = Path(__file__).with_name("scatter_worker.py")


def test_dp_rows_are_the_plan_rows():
    # Mini-batch m = rows [8m, 8m + 8); dp rank 1 of 4 takes every 4th from 8m + 1.
    assert dp_rows(16, 2, 1, 4) == [1, 5, 9, 13]
    assert dp_rows(16, 2, 0, 2) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert sorted(i for r in range(4) for i in dp_rows(16, 2, r, 4)) == list(range(16))
    with pytest.raises(ValueError, match="16 responses do not split into 3 mini-batches x 2"):
        dp_rows(16, 3, 0, 2)
    with pytest.raises(ValueError, match="do not split into 2 mini-batches x 3"):
        dp_rows(16, 2, 0, 3)


def test_rank_rows_rebuild_each_sample_exactly():
    batch, adv = make_batch(seed=3)
    rows = [1, 6, 14]
    got = RankRows.from_batch(batch, adv, rows, routed_experts=True)
    width = int((batch.prompt_lengths[rows] + batch.response_lengths[rows]).max())
    assert got.tokens.shape == (3, width)  # trimmed to these rows' longest sample
    for j, i in enumerate(rows):
        n = int(batch.prompt_lengths[i] + batch.response_lengths[i])
        assert torch.equal(got.tokens[j, :n], batch.tokens[i, :n])
        assert torch.equal(got.response_mask[j], batch.response_mask[i, :width])
        assert torch.equal(got.rollout_logprobs[j], batch.rollout_logprobs[i, :width])
        assert torch.equal(got.routed_experts[j], batch.routed_experts[i])
    assert torch.equal(got.advantages, adv[rows].float())
    assert RankRows.from_batch(batch, adv, rows, routed_experts=False).routed_experts is None


@pytest.fixture
def world_of_one():
    init_distributed(ParallelConfig())
    yield
    destroy_distributed()


def test_plan_of_a_rank_trains_on_its_rows(world_of_one):
    batch, adv = make_batch(seed=1)
    plan = plan_mini_batches(batch, adv, MINI, DataLayout(dp_rank=1, dp_size=2, micro_batch_size=3))
    rows = dp_rows(batch.batch_size, MINI, 1, 2)
    got = [rows[i] for micro_batches in plan for micro in micro_batches for i in micro.indices]
    assert got == rows and len(plan) == MINI
    first = plan[0][0]
    assert torch.equal(first.advantages, adv[rows[:3]].float())


@pytest.mark.multiprocess
def test_each_rank_receives_exactly_its_rows(tmp_path):
    cmd = [*torchrun(4, WORKER), f"--result={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for layout, (tp, _, cp) in LAYOUTS.items():
        for routes in (False, True):
            per_rank = [r[f"{layout}/routes={routes}"] for r in results]
            assert {r["dp_size"] for r in per_rank} == {4 // (tp * cp)}
            for r in per_rank:
                assert r["mismatch"] == [] and r["rows"] == r["expected_rows"] == 16 // r["dp_size"]
                assert r["has_routes"] is routes
                assert (
                    r["object_calls"] >= 1 and r["object_calls_on_control"] and r["control_backend"] == "gloo"
                )
                assert not r["data_on_control"] and r["data_devices"] == [results[0]["device"]]
            # Rank 0 scatters over its data-parallel group; TP (and CP) peers get their leader's copy.
            assert "scatter" in per_rank[0]["data_calls"]
            assert all(("broadcast" in r["data_calls"]) == (tp * cp > 1) for r in per_rank)
        assert all(r[f"{layout}/error"] == "IndexError" for r in results)
