"""The chunked cross entropy at TP2 (run under torchrun --nproc_per_node=2).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/model/chunked_ce_worker.py --out R

Both ranks hold the same full logits and take their half of the vocabulary. Every rank writes
`<out>.rank<r>.json`: whether loss and logits gradient equal megatron's vocab-parallel CE bit for
bit (ragged small chunks and one chunk; fp32 and bf16) and the largest differences of the loss
and of the entropy from the full vocabulary's, computed in float64 on one rank.
"""

import argparse
import json

import torch
import torch.distributed as dist

from megatron_gspo.model import chunked_cross_entropy as chunked
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed

TP, VOCAB, TEMPERATURE = 2, 96, 0.7


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init_distributed(ParallelConfig(tensor_parallel=TP), seed=0)
    rank = dist.get_rank()
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    generator = torch.Generator().manual_seed(0)
    full = torch.randn(7, 5, VOCAB, generator=generator) * 4
    target = torch.randint(0, VOCAB, (7, 5), generator=generator)  # targets on both halves
    upstream = torch.linspace(-1.0, 2.0, 35).view(7, 5)
    shard = full[..., rank * VOCAB // TP : (rank + 1) * VOCAB // TP]
    expected = (
        -torch.log_softmax(full.double() / TEMPERATURE, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    )
    log_p = torch.log_softmax(full.double() / TEMPERATURE, -1)
    full_entropy = -(log_p.exp() * log_p).sum(-1)
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = shard.to(dtype)
        theirs_in = logits.clone().requires_grad_()
        theirs = vocab_parallel_cross_entropy(theirs_in.float() / TEMPERATURE, target)
        (theirs * upstream).sum().backward()
        for rows in (3, 10_000):
            chunked.chunk_tokens = lambda logits, rows=rows: rows
            ours_in = logits.clone().requires_grad_()
            ours = chunked.chunked_vocab_parallel_cross_entropy(ours_in, target, temperature=TEMPERATURE)
            (ours * upstream).sum().backward()
            name = f"{str(dtype).split('.')[-1]}_chunk{rows}"
            result[f"{name}_equal"] = bool(
                torch.equal(ours, theirs) and torch.equal(ours_in.grad, theirs_in.grad)
            )
            if dtype == torch.float32:
                result[f"{name}_vs_float64"] = (ours.double() - expected).abs().max().item()
                entropy = chunked.chunked_vocab_parallel_entropy(logits, temperature=TEMPERATURE)
                result[f"{name}_entropy_vs_float64"] = (entropy.double() - full_entropy).abs().max().item()
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
