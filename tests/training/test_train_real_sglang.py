"""`megatron-gspo train` with rollout.engine=sglang: real SGLang 0.5.23 servers (CPU engine) in the loop.

One run covers what the embedded server can only imitate: the trainer starts SGLang itself,
replays SGLang's routed experts (GRPO + R3), samples one version ahead (max_staleness=1, pause
updates: SGLang's own retract pause), syncs over SGLang's update group (gloo), and stops the
server with the run.
"""

import math
import re

import httpx
import pytest
from sglang_runs import rl_steps, train_with_sglang

from megatron_gspo.rollout.sglang_launch import sglang_unavailable

pytestmark = [
    pytest.mark.slow,  # SGLang's start (~35 s) and a 3-step run
    pytest.mark.skipif(sglang_unavailable() is not None, reason=str(sglang_unavailable())),
]

REPLAY_AHEAD = [
    "algorithm.loss_type=grpo",
    "algorithm.loss_options={}",
    "algorithm.routing_replay=r3",
    "drift.enabled=true",
    "rollout.max_staleness=1",
    # pause (SGLang's retract), not partial: under partial, real SGLang once returned a row of the
    # last batch aborted without a sync to resume it after (FinishReasonError, .ci/run at 69af7be,
    # 3.12 stage); the embedded server never does. Open: see the stop note of 2026-12-08.
    "rollout.update_mode=pause",
]


def test_grpo_r3_async_run_against_real_sglang(tmp_path):
    done = train_with_sglang(tmp_path, *REPLAY_AHEAD)
    url = re.search(r"SGLang server on (http://\S+) serving", done.stderr).group(1)
    with pytest.raises(httpx.TransportError):  # stopped with the run
        httpx.get(f"{url}/health", timeout=5)
    log = (tmp_path / "sglang" / "server-0.log").read_text()
    assert "Prefill batch" in log  # SGLang's own scheduler served
    trained = [r for r in rl_steps(tmp_path) if r["train/all_zero_adv_batch"] == 0.0]
    assert trained, "no step trained"
    for record in trained:
        assert record["routing/replay_bytes_per_token"] == 2 * 2  # SGLang's routes: 2 layers x top-2
        assert record["drift/infer_train/mean"] <= 0.02  # fp32 on both sides: ties only
        mismatch = [
            v for k, v in record.items() if k.startswith("rollout/mismatch") and k.endswith("abs_diff_mean")
        ]
        assert mismatch and all(math.isfinite(v) and v < 0.05 for v in mismatch)
