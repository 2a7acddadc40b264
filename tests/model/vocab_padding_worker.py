"""torchrun worker: a vocabulary TP does not divide, padded as megatron pads it, at TP=2.

    python -m torch.distributed.run --standalone --nproc_per_node 2 vocab_padding_worker.py \
        --hf DIR --out EXPORT_DIR --result result.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", type=Path, required=True, help="HF checkpoint whose vocab_size is odd")
    parser.add_argument("--out", type=Path, required=True, help="export directory")
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()

    import torch.distributed as dist

    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
    from megatron_gspo.model.hf.convert import (
        load_hf_checkpoint,
        random_tokens,
        read_hf_config,
    )
    from megatron_gspo.model.hf.export import export_hf_checkpoint
    from megatron_gspo.model.logprobs import sequence_logprobs

    parallel = ParallelConfig(tensor_parallel=2)
    init_distributed(parallel, seed=5)
    cfg = read_hf_config(args.hf)
    model = build_model(cfg, parallel).eval()
    load_hf_checkpoint(model, args.hf)
    tokens = random_tokens(cfg.vocab_size, 3, 40, seed=6)
    with torch.no_grad():
        logprobs, entropy = sequence_logprobs(model, list(tokens), with_entropy=True, pad_multiple=2)
    export_hf_checkpoint(model, args.out, cfg)
    if dist.get_rank() == 0:
        args.result.write_text(
            json.dumps(
                {
                    "megatron_vocab": model.vocab_size,
                    "logprobs": logprobs.tolist(),
                    "entropy": entropy.tolist(),
                }
            )
        )
    destroy_distributed()


if __name__ == "__main__":
    main()
