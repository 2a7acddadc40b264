"""`megatron-gspo export`: a training checkpoint (any layout) -> an HF checkpoint directory.

    megatron-gspo export --checkpoint runs/x/checkpoints/step_00000040 --out hf/step40
    megatron-gspo export --checkpoint C --out D --tp 2 --ep 2 --nproc 4       (CPU: self-launches)
    megatron-gspo export --checkpoint C --out D --pp 2 --nproc 2             (pipeline stages)
    torchrun --nproc-per-node 8 -m megatron_gspo.cli export --checkpoint C --out D --ep 8   (GPU)

The checkpoint's `model/` holds the architecture (and the run's tokenizer); every rank builds
its shard of that model at the requested layout, verifies and loads the weights from `dist/`
(resharded by megatron's `dist_checkpointing`), then `export_hf_checkpoint` streams the
global tensors to rank 0, which writes each safetensors shard as it fills: no rank holds the
whole model unless the layout is a world of one. Under pipeline parallelism each stage loads its
own layers and the stages take turns sending theirs, one tensor at a time.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from megatron_gspo.checkpoint.source import resolve_checkpoint
from megatron_gspo.config import ConfigError


def add_export_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megatron-gspo export`."""
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="training checkpoint (RUN/checkpoints/step_N) or run dir (RUN)",
    )
    parser.add_argument(
        "--out", required=True, help="HF checkpoint directory to create (or an earlier export to replace)"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to load with")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to load with")
    parser.add_argument(
        "--ep", type=int, default=None, help="expert-parallel size (default: world / (TP x PP))"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an HF model at --out that another tool saved (never a directory with other files)",
    )
    parser.add_argument("--max-shard-bytes", type=int, default=None, help="safetensors shard size limit")
    parser.add_argument("--nproc", type=int, default=1, help="re-launch under torchrun with N CPU workers")


def _model_description(checkpoint: Path):
    """(architecture, tokenizer or None) recorded in the checkpoint's `model/` directory."""
    from megatron_gspo.checkpoint.meta import MODEL_DIR, CheckpointError, read_meta
    from megatron_gspo.model.hf.config import read_hf_config

    try:
        meta = read_meta(checkpoint)
    except CheckpointError as err:
        raise ConfigError(f"--checkpoint {checkpoint}: {err}") from None
    config = checkpoint / MODEL_DIR / "config.json"
    if f"{MODEL_DIR}/config.json" not in meta["files"]:
        raise ConfigError(
            f"--checkpoint {checkpoint} records no model architecture ({config}): "
            "it was saved without `model_cfg`"
        )
    model_cfg = read_hf_config(checkpoint / MODEL_DIR)  # a refused or unreadable one: HFConfigError
    tokenizer = None
    if (checkpoint / MODEL_DIR / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint / MODEL_DIR))
    return meta, model_cfg, tokenizer


def _layout(args: argparse.Namespace, world: int, model_cfg):
    from megatron_gspo.model.distributed import ParallelConfig

    tp, pp = args.tp, args.pp
    ep = args.ep if args.ep is not None else max(world // (tp * pp), 1)
    if min(tp, pp, ep) < 1 or world % (tp * pp * ep) or model_cfg.num_experts % ep:
        raise ConfigError(
            f"export layout TP={tp} PP={pp} EP={ep} does not fit {world} process(es) and "
            f"{model_cfg.num_experts} experts: TP x PP x EP must divide the world size and EP the number "
            "of experts"
        )
    if model_cfg.num_layers % pp:
        raise ConfigError(f"export layout PP={pp} does not divide the model's {model_cfg.num_layers} layers")
    return ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)


def run_export(args: argparse.Namespace) -> int:
    """Entry point: check the arguments, re-launch under torchrun on CPU if asked, export."""
    source = resolve_checkpoint(args.checkpoint, "--checkpoint")  # a run directory: its newest intact step
    if source.kind != "training":
        raise ConfigError(
            f"--checkpoint {source.given} is already an HF checkpoint directory; export takes a training "
            "checkpoint (RUN/checkpoints/step_NNNNNNNN) or a run directory (RUN)"
        )
    checkpoint = source.path
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    from megatron_gspo.model.hf.checkpoint import ExportTargetError, check_export_target

    try:
        check_export_target(
            args.out, overwrite=args.overwrite
        )  # before any work; the writer checks again before replacing
    except ExportTargetError as err:
        raise ConfigError(f"--out {err}") from None
    meta, model_cfg, tokenizer = _model_description(checkpoint)
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    parallel = _layout(args, world, model_cfg)
    if args.nproc > 1 and "RANK" not in os.environ:
        from megatron_gspo.training.launch import relaunch

        return relaunch(args.nproc)
    from megatron_gspo.checkpoint.meta import CheckpointError

    try:
        path = export_training_checkpoint(
            checkpoint, args.out, parallel, model_cfg, tokenizer, args.max_shard_bytes, args.overwrite
        )
    except CheckpointError as err:  # damaged or not this model: the user's to fix, named
        raise ConfigError(f"--checkpoint {checkpoint}: {err}") from None
    if os.environ.get("RANK", "0") == "0":
        print(f"exported step {meta['step']} of {checkpoint} to {path}", flush=True)
    return 0


def export_training_checkpoint(
    checkpoint: Path, out: str | os.PathLike, parallel, model_cfg, tokenizer, max_shard_bytes, overwrite=False
):
    """Build the model at `parallel`, load the checkpoint's weights, write HF (collective)."""
    from megatron_gspo.checkpoint.load import load_weights
    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.distributed import destroy_distributed, init_distributed
    from megatron_gspo.model.hf.export import export_hf_checkpoint

    init_distributed(parallel)
    try:
        model = build_model(model_cfg, parallel)
        load_weights(checkpoint, model)
        return export_hf_checkpoint(
            model, out, model_cfg, tokenizer, max_shard_bytes=max_shard_bytes, overwrite=overwrite
        )
    finally:
        destroy_distributed()
