"""A world-one policy loaded from a fresh tiny HF checkpoint: what the weight-sync tests start from."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import MoEModelConfig
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.model.hf.convert import load_hf_checkpoint


@contextlib.contextmanager
def world_one_policy(
    directory: Path, cfg: MoEModelConfig, seed: int
) -> Iterator[tuple[torch.nn.Module, Path]]:
    """(model in eval mode, its checkpoint `directory`/ckpt); the process group lives inside."""
    checkpoint = make_tiny_hf_checkpoint(directory / "ckpt", cfg)
    init_distributed(ParallelConfig(), seed=seed)
    model = build_model(cfg, ParallelConfig()).eval()
    load_hf_checkpoint(model, checkpoint, cfg)
    yield model, checkpoint
    destroy_distributed()
