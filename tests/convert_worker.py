"""HF checkpoint fixtures for the conversion tests, and the torchrun worker of the TP x EP test.

    python -m torch.distributed.run --standalone --nproc_per_node 4 convert_worker.py \
        --tp 2 --ep 2 --work DIR --result result.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from megatron_gspo.model.config import MoEModelConfig, tiny
from megatron_gspo.model.hf.checkpoint import build_hf_model, module_state_to_hf, save_hf_state_dict

VOCAB = 48


def make_checkpoint(path: Path, cfg: MoEModelConfig, seed: int = 0) -> Path:
    """A random HF checkpoint whose RMSNorm gains are random too (ones would hide swapped norms)."""
    model = build_hf_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    state = model.state_dict()
    for name, tensor in state.items():
        if "norm" in name:
            tensor.copy_(1.0 + 0.3 * torch.randn(tensor.shape, generator=gen))
    return save_hf_state_dict(path, module_state_to_hf(state), cfg)


# Checkpoints for the multi-process test: default init, and sharp logits/routing with tied
# embeddings and no top-k renormalisation.
CASES = {
    "default": tiny(vocab_size=VOCAB),
    "sharp_tied": tiny(vocab_size=VOCAB, init_std=0.2, tie_word_embeddings=True, norm_topk_prob=False),
}


def poisoned_export(model, out: Path, cfg) -> dict:
    """The last rank alone puts a NaN into a replicated tensor: every rank must refuse the export
    (none left waiting in a collective) and the previous export must stay as it was."""
    import torch.distributed as dist

    from megatron_gspo.model.hf.convert import ConversionError
    from megatron_gspo.model.hf.export import export_hf_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    before = {p.name: p.read_bytes() for p in out.iterdir()} if rank == 0 else None
    param = dict(model.named_parameters())["decoder.final_layernorm.weight"]
    saved = param.detach().clone()
    if rank == world - 1:
        with torch.no_grad():
            param[0] = float("nan")
    try:
        export_hf_checkpoint(model, out, cfg)
        outcome = "exported"
    except ConversionError as err:
        outcome = str(err)
    finally:
        with torch.no_grad():
            param.copy_(saved)
    outcomes = [None] * world
    dist.all_gather_object(outcomes, outcome)
    unchanged = rank != 0 or before == {p.name: p.read_bytes() for p in out.iterdir()}
    return {"outcomes": outcomes, "unchanged": unchanged}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--ep", type=int, required=True)
    parser.add_argument("--work", type=Path, required=True, help="holds <case>/ checkpoints; exports go here")
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
    from megatron_gspo.model.hf.checkpoint import load_hf_state_dict
    from megatron_gspo.model.hf.convert import (
        hf_token_logprobs,
        load_hf_checkpoint,
        logprob_diff,
        random_tokens,
    )
    from megatron_gspo.model.hf.export import export_hf_checkpoint

    results = {}
    # Experts split over TP like attention (megatron's default), then experts kept whole (ETP=1).
    runs = [(case, None) for case in CASES] + [("default", 1)]
    for case, expert_tp in runs:
        parallel = ParallelConfig(
            tensor_parallel=args.tp, expert_parallel=args.ep, expert_tensor_parallel=expert_tp
        )
        init_distributed(parallel, seed=7)
        cfg, src, name = (
            CASES[case],
            args.work / case,
            case if expert_tp is None else f"{case}@etp{expert_tp}",
        )
        model = build_model(cfg, parallel).eval()
        stats = load_hf_checkpoint(model, src, cfg)
        hf_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        tokens = random_tokens(cfg.vocab_size, batch=4, length=40, seed=3)
        worst, mean = logprob_diff(
            model, lambda t, m=hf_model: hf_token_logprobs(m, t), tokens, pad_multiple=args.tp
        )
        exported = export_hf_checkpoint(model, args.work / f"{name}-export", cfg)
        if name == "default":
            results["poisoned"] = poisoned_export(model, args.work / f"{name}-export", cfg)
        bytes_read = [0] * dist.get_world_size()
        dist.all_gather_object(bytes_read, stats.bytes_read)
        if dist.get_rank() == 0:
            original, written = load_hf_state_dict(src), load_hf_state_dict(exported)
            results[name] = {
                "max": worst,
                "mean": mean,
                "same_keys": original.keys() == written.keys(),
                "unequal": sorted(
                    k for k in original if k in written and not torch.equal(original[k], written[k])
                ),
                "bytes_read": bytes_read,
                "checkpoint_bytes": sum(t.numel() * t.element_size() for t in original.values()),
            }
    if dist.get_rank() == 0:
        args.result.write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    main()
