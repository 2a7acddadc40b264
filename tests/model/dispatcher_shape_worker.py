"""torchrun worker (2 ranks, EP=2): the shape each rank's micro-batch is padded to, per dispatcher.

The two ranks pack different samples (as data-parallel ranks do). Rank 0 prints one JSON list
of {"rank", "dispatcher", "layout", "own", "padded"} rows of both ranks.
"""

import json

import torch
import torch.distributed as dist

from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.packing import pack_sequences, uniform_shape


def main() -> None:
    rows = []
    for dispatcher in ("alltoall", "allgather"):
        init_distributed(ParallelConfig(expert_parallel=2, token_dispatcher=dispatcher))
        rank = dist.get_rank()
        lengths = [[5, 9, 3], [17, 4]][rank]
        for layout in ("mask", "thd"):
            packed = pack_sequences([torch.arange(1, n + 1) for n in lengths], layout=layout)
            shapes = {"own": list(packed.tokens.shape), "padded": list(uniform_shape(packed))}
            rows.append({"rank": rank, "dispatcher": dispatcher, "layout": layout, **shapes})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() == 0:
        print(json.dumps([row for part in everyone for row in part]))
    destroy_distributed()


if __name__ == "__main__":
    main()
