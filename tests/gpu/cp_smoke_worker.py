"""torchrun worker of the context-parallel GPU smoke check (2 GPUs, TransformerEngine spec, bf16).

    python -m torch.distributed.run --standalone --nproc_per_node 2 cp_smoke_worker.py --result DIR

1. The tiny policy at CP=2: every rank's `partition_index` equals TransformerEngine's own
   `thd_get_partitioned_indices` for the packed row.
2. Its per-token log-probs (THD, sequences padded to 2 x CP) and the gradient of their sum
   (parameter gradients summed over the CP ranks) against the same weights at CP=1.
Each rank writes its figures to DIR/rank{r}.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

LENGTHS = [37, 64, 5, 120, 18]


def _logprobs_and_grads(model, samples, pad_multiple: int, cp_group) -> tuple[torch.Tensor, dict]:
    from megatron_gspo.model.logprobs import sequence_logprobs

    logprobs, _ = sequence_logprobs(model, samples, pad_multiple=pad_multiple, layout="thd")
    logprobs.sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.detach().float().clone()
        if cp_group is not None:  # each CP rank's gradient covers its own tokens
            dist.all_reduce(grad, group=cp_group)
        grads[name] = grad
    return logprobs.detach().float(), grads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    import transformer_engine_torch as tex

    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.config import tiny
    from megatron_gspo.model.context_parallel import context_parallel_state, partition_index
    from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
    from megatron_gspo.model.engine import EngineConfig
    from megatron_gspo.model.packing import pack_sequences

    engine = EngineConfig(dtype="bf16", use_te=True)
    model_cfg = tiny(vocab_size=96)
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 96, (n,), generator=gen) for n in LENGTHS]

    cp_layout = ParallelConfig(context_parallel=2)
    init_distributed(cp_layout, seed=1234)
    size, rank, group = context_parallel_state()
    packed = pack_sequences(samples, layout="thd", pad_multiple=cp_layout.pad_multiple)
    cu = packed.cu_seqlens_padded()
    ours = partition_index(cu, size, rank)
    theirs = tex.thd_get_partitioned_indices(cu.cuda(), packed.tokens.shape[1], size, rank)
    model = build_model(model_cfg, cp_layout, engine)
    with torch.no_grad():  # the same weights on both CP ranks, whatever each initialised
        for param in model.parameters():
            dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    cp_logprobs, cp_grads = _logprobs_and_grads(model, samples, cp_layout.pad_multiple, group)
    destroy_distributed()

    init_distributed(ParallelConfig(), seed=1234)  # CP=1 (two data-parallel ranks)
    reference = build_model(model_cfg, ParallelConfig(), engine)
    reference.load_state_dict(weights, strict=False)
    ref_logprobs, ref_grads = _logprobs_and_grads(reference, samples, 1, None)
    diff = (cp_logprobs - ref_logprobs).abs()
    relative = {
        name: float((cp_grads[name] - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-12))
        for name in ref_grads
    }
    result = {
        "cp": [size, rank],
        "index_equals_te": torch.equal(ours, theirs.cpu().to(torch.int64)),
        "logprob_max": float(diff.max()),
        "logprob_mean": float(diff.mean()),
        "grad_relative_worst": max(relative.values()),
        "grad_worst_name": max(relative, key=relative.get),
    }
    Path(args.result, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
