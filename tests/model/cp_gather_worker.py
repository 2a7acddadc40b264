"""torchrun worker (2 ranks, CP=2): the log-prob gather over megatron's context-parallel group.

    python -m torch.distributed.run --standalone --nproc_per_node 2 cp_gather_worker.py --result DIR

Each rank holds its partition of a THD row's per-position values; the gather must rebuild the
row in position order on both ranks, and the backward of a loss computed on the whole row
must hand each rank exactly the gradient at its own positions.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.model.context_parallel import context_parallel_state, gather_positions, partition_index
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.packing import pack_sequences


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    init_distributed(ParallelConfig(context_parallel=2))
    size, rank, group = context_parallel_state()
    packed = pack_sequences([list(range(1, n + 1)) for n in (5, 9, 2)], layout="thd", pad_multiple=4)
    cu = packed.cu_seqlens_padded()
    length = packed.tokens.shape[1]
    row = torch.linspace(-1.0, 1.0, length).unsqueeze(0)  # the same on both ranks
    weights = torch.arange(length, dtype=torch.float32).unsqueeze(0)
    index = partition_index(cu, size, rank)
    local = row[:, index].clone().requires_grad_()
    gathered = gather_positions(local, cu, index, group)
    (gathered * weights).sum().backward()
    result = {
        "cp": [size, rank],
        "row_restored": torch.equal(gathered.detach(), row),
        "own_gradient": torch.equal(local.grad, weights[:, index]),
        "local_positions": local.shape[1],
        "row_positions": length,
    }
    Path(args.result, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
