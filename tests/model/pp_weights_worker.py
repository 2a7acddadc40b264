"""Torchrun worker: global weights, HF import and HF export at a pipeline-parallel layout.

    python -m torch.distributed.run --standalone --nproc_per_node 4 pp_weights_worker.py \
        --pp 2 --ep 2 --work DIR --result result.json

For each case of `CASES` (HF checkpoints `DIR/<case>` written beforehand by the test) every
rank builds its stage of the 4-layer tiny model at the layout and checks, against references
that do not go through the sharding code:
- import: `load_hf_checkpoint` (each stage reads its own layers: bytes read are reported),
  then every global tensor gathered back equals `hf_to_megatron` of the checkpoint read whole;
- export: `export_hf_checkpoint` writes exactly the checkpoint's tensors, bit for bit;
- global state: a perturbed global state dict loaded with `load_global_state_dict` gathers
  back unchanged, and an unknown tensor is refused on every stage.
Rank 0 writes what it found to `--result`, with the names of tensors that differ.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from megatron_gspo.model.config import tiny

VOCAB = 48
CASES = {
    "untied": tiny(vocab_size=VOCAB, num_layers=4),
    "tied": tiny(vocab_size=VOCAB, num_layers=4, tie_word_embeddings=True, init_std=0.2),
}


def _unequal(got: dict, want: dict) -> list[str]:
    if got.keys() != want.keys():
        return sorted(set(got) ^ set(want))
    return sorted(k for k in want if not torch.equal(got[k], want[k]))


def _perturbed(state: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)  # the same draw on every rank
    return {k: v + torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in sorted(state.items())}


def check_case(case: str, parallel, work: Path) -> dict:
    """Import, export and global-state round trip of one case at `parallel` (collective)."""
    import torch.distributed as dist

    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.hf.checkpoint import load_hf_state_dict
    from megatron_gspo.model.hf.convert import hf_to_megatron, load_hf_checkpoint
    from megatron_gspo.model.hf.export import export_hf_checkpoint
    from megatron_gspo.model.sharding import ShardingError, gather_global_state_dict, load_global_state_dict

    cfg, src = CASES[case], work / case
    model = build_model(cfg, parallel).eval()
    stats = load_hf_checkpoint(model, src, cfg)
    bytes_read = [0] * dist.get_world_size()
    dist.all_gather_object(bytes_read, stats.bytes_read)
    original = load_hf_state_dict(src)
    reference = hf_to_megatron(original, cfg)
    imported = gather_global_state_dict(model)
    exported = load_hf_state_dict(export_hf_checkpoint(model, work / f"{case}-export", cfg))
    target = _perturbed(reference, seed=11)
    load_global_state_dict(model, target)
    round_trip = gather_global_state_dict(model)
    try:
        load_global_state_dict(model, {**target, "decoder.layers.1.extra.weight": torch.zeros(1)})
        refused = None
    except ShardingError as err:
        refused = str(err)
    refusals = [None] * dist.get_world_size()
    dist.all_gather_object(refusals, refused)
    return {
        "import_unequal": _unequal(imported, reference),
        "export_unequal": _unequal(exported, original),
        "round_trip_unequal": _unequal(round_trip, target),
        "num_tensors": len(reference),
        "bytes_read": bytes_read,
        "checkpoint_bytes": sum(t.numel() * t.element_size() for t in original.values()),
        "refusals": refusals,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None, help="parallel.virtual_pipeline")
    parser.add_argument("--first", type=int, default=None, help="parallel.first_stage_layers")
    parser.add_argument("--last", type=int, default=None, help="parallel.last_stage_layers")
    parser.add_argument("--work", type=Path, required=True, help="holds <case>/ HF checkpoints")
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()

    import torch.distributed as dist

    from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed

    parallel = ParallelConfig(
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        expert_parallel=args.ep,
        virtual_pipeline=args.vpp,
        first_stage_layers=args.first,
        last_stage_layers=args.last,
    )
    init_distributed(parallel, seed=7)
    results = {case: check_case(case, parallel, args.work) for case in CASES}
    if dist.get_rank() == 0:
        args.result.write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    main()
