"""The KL loss (k1/k2/k3) and the reward-side KL with their reference model at TP2 and at EP2
(torchrun, gloo) equal a world of one."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from forked_torchrun import torchrun
from kl_worker import ESTIMATORS, KEYS, MODEL, TOKEN_KL_KEYS, run

from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint

WORKER = Path(__file__).with_name("kl_worker.py")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kl_loss_at_tp2_and_ep2_equals_one_process(tmp_path):
    hf = make_tiny_hf_checkpoint(tmp_path / "policy", MODEL, seed=5)
    ref = make_tiny_hf_checkpoint(tmp_path / "reference", MODEL, seed=6)  # another policy: KL > 0 at once
    init_distributed(ParallelConfig(), seed=3)
    try:
        expected = run(ParallelConfig(), str(hf), str(ref))
    finally:
        destroy_distributed()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for tp, ep in ((2, 1), (1, 2)):
        result = tmp_path / f"tp{tp}_ep{ep}.json"
        args = [f"--hf={hf}", f"--ref={ref}", f"--tp={tp}", f"--ep={ep}", f"--result={result}"]
        cmd = [*torchrun(2, WORKER), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        got = json.loads(result.read_text())
        for estimator in ESTIMATORS:
            assert expected[estimator]["actor/kl_ref_first_mb"] > 1e-3  # the reference differs from the start
            for key in KEYS:
                assert got[estimator][key] == pytest.approx(expected[estimator][key], rel=1e-4, abs=1e-7), (
                    tp, ep, estimator, key,
                )  # fmt: skip
        assert abs(expected["token_kl"]["critic/kl"]) > 1e-4
        for key in TOKEN_KL_KEYS:
            want = expected["token_kl"][key]
            assert got["token_kl"][key] == pytest.approx(want, rel=1e-4, abs=1e-7), (tp, ep, key)
