"""Context parallelism on 2 GPUs (TransformerEngine spec, bf16): CP=2 against CP=1.

The slicing itself is checked on CPU against a plain reading of megatron's load-balanced split
(`tests/model/test_context_parallel.py`); only TransformerEngine's CP attention needs a GPU.
Tolerances are the packed-vs-per-row bf16 bounds (`gpu_checks.PACKED_BF16_TOL`): CP splits
the same attention over two ranks, another rounding order of the same sums.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ CUDA devices for CP=2, found {GPUS}")


def test_cp2_log_probs_and_gradients_match_cp1(tmp_path, record_property):
    import gpu_checks as checks

    if checks.te_import_error():
        pytest.skip(f"context parallelism needs TransformerEngine: {checks.te_import_error()}")
    worker = Path(__file__).with_name("cp_smoke_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(worker), f"--result={tmp_path}"]  # fmt: skip
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    worst, mean = checks.PACKED_BF16_TOL
    for r in results:
        assert r["index_equals_te"], f"rank {r['cp'][1]}: partition_index differs from TE's"
        assert r["logprob_max"] <= worst and r["logprob_mean"] <= mean, r
        assert r["grad_relative_worst"] <= 0.05, r
    record_property(
        "figure",
        f"CP2 vs CP1: log-prob max {max(r['logprob_max'] for r in results):.3g}, "
        f"mean {max(r['logprob_mean'] for r in results):.3g}; grad rel "
        f"{max(r['grad_relative_worst'] for r in results):.3g}",
    )
