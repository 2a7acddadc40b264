"""`megatron-gspo parity` on 2+ GPUs under torchrun (NCCL): TP2, EP2 and TP2 x EP2 vs TP=EP=1.

The parity command builds the tiny policy at TP=EP=1 and at the layout with the same global
weights and compares per-token log-probs and one Adam step (exit 1 above its 1e-5 tolerance,
fp32, the TE spec when TE imports). Expert TP defaults to TP, so TP2 x EP2 needs 4 ranks.
"""

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ CUDA devices for torchrun parity, found {GPUS}")


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "ep2", "tp2xep2"])
def test_parity(tp, ep, record_property):
    import gpu_checks as checks

    from megatron_gspo.analysis.parity import required_world_size

    world = required_world_size(tp, ep)
    if GPUS < world:
        pytest.skip(f"TP{tp} x EP{ep} needs {world} GPUs (expert TP = TP), found {GPUS}")
    record_property("figure", checks.run_parity(tp, ep, nproc=world))
