"""`megatron-gspo parity` with a sharding bug injected into the layout run (negative control).

    python -m torch.distributed.run --standalone --nproc_per_node 2 parity_bug_worker.py \
        expert_swap --tp 1 --ep 2 --dtype bf16

A weight bug is applied where the layout run loads the reference's global weights, so the
sharded model holds what a wrong shard mapping would give it; `unscaled_dp_loss` drops the
data-parallel loss factor (`dp_loss_scale`) in the layout run, so its gradients are halved.
The TP=1 runs are untouched.
"""

from __future__ import annotations

import argparse
import sys

import torch

from megatron_gspo.analysis import parity
from megatron_gspo.model import optim, sharding

EXPERTS = "decoder.layers.0.mlp.experts.local_experts"
FC2 = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"


def expert_swap(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer 0's experts 0 and 1 exchanged: an expert numbering off between EP ranks."""
    out = dict(weights)
    for kind in ("linear_fc1", "linear_fc2"):
        a, b = f"{EXPERTS}.0.{kind}.weight", f"{EXPERTS}.1.{kind}.weight"
        out[a], out[b] = weights[b], weights[a]
    return out


def tp_slice_swap(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One expert's fc2 input halves exchanged: two TP ranks holding each other's slice."""
    first, second = weights[FC2].chunk(2, dim=1)
    return {**weights, FC2: torch.cat([second, first], dim=1)}


WEIGHT_BUGS = {"expert_swap": expert_swap, "tp_slice_swap": tp_slice_swap}


def sharded() -> bool:
    """Whether this is the layout run (not one of the TP=1 runs)."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size() * ps.get_expert_model_parallel_world_size() > 1


def main() -> int:
    bug = sys.argv[1]
    if bug == "unscaled_dp_loss":
        correct_scale = optim.dp_loss_scale
        optim.dp_loss_scale = lambda: 1 if sharded() else correct_scale()
    else:
        correct_load = sharding.load_global_state_dict
        sharding.load_global_state_dict = lambda model, weights: correct_load(
            model, WEIGHT_BUGS[bug](weights) if sharded() else weights
        )
    parser = argparse.ArgumentParser()
    parity.add_parity_args(parser)
    return parity.run_parity(parser.parse_args(sys.argv[2:]))


if __name__ == "__main__":
    sys.exit(main())
