"""`grads_are_finite` flags exactly the NaN / inf gradients, also where finite values overflow the norm;
under torchrun a NaN on one rank (dense or expert buffer, DP2 and EP2) refuses the step on every rank."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from forked_torchrun import torchrun

from megatron_gspo.model.optim import grads_are_finite, wrap_ddp


@pytest.fixture(scope="module")
def ddp_model(world_one_model):
    return wrap_ddp(world_one_model)


NON_FINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize(
    "value,finite",
    [(0.0, True), (-3.0e38, True), *((v, False) for v in NON_FINITE)],
    ids=["zero", "most-negative-fp32", "nan", "inf", "-inf"],
)
@pytest.mark.parametrize("fill", [1.0, 3.0e38], ids=["small", "largest-fp32"])  # fp32 norm finite / inf
def test_grads_are_finite_flags_exactly_the_non_finite_values(ddp_model, fill, value, finite):
    buffers = [b.grad_data for b in ddp_model.buffers + ddp_model.expert_parallel_buffers]
    assert buffers
    for grad in buffers:
        grad.fill_(fill)
        assert grads_are_finite(ddp_model)
        grad.view(-1)[grad.numel() // 2] = value
        assert grads_are_finite(ddp_model) is finite
        grad.zero_()


@pytest.mark.multiprocess
@pytest.mark.parametrize("ep", [1, 2], ids=["dp2", "ep2"])
def test_a_nan_on_one_rank_refuses_the_step_on_every_rank(tmp_path, ep):
    worker = Path(__file__).with_name("grads_finite_worker.py")
    done = subprocess.run(
        [*torchrun(2, worker), "--out", str(tmp_path / "r"), "--ep", str(ep)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"r.rank{r}.json").read_text()) for r in range(2)]
    kinds = ("dense", "expert") if ep == 2 else ("dense",)
    assert {case.split("/")[0] for case in ranks[0]} == set(kinds)
    for kind in kinds:
        for nan_rank in ("None", "0", "1"):
            case = f"{kind}/nan_on_{nan_rank}"
            clean = nan_rank == "None"  # the control: the same step without a NaN is taken
            for rank, result in enumerate(ranks):
                assert result[case] == {"finite": clean, "stepped": clean, "unchanged": not clean}, (
                    case,
                    rank,
                )
