"""Write the policy as an HF checkpoint directory, streamed one global tensor at a time.

For weight sync through disk and for `megatron-gspo export`: the converters (`model/hf/convert.py`)
name and reshape each tensor the stream (`model/hf/stream.py`) gathers; an
`HFCheckpointWriter` (`model/hf/checkpoint.py`) shards and publishes the directory atomically.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_gspo.model.config import MoEModelConfig
from megatron_gspo.model.distributed import unwrap_model
from megatron_gspo.model.hf.checkpoint import HFCheckpointWriter
from megatron_gspo.model.hf.convert import built_architecture, check_same_architecture
from megatron_gspo.model.hf.stream import refuse_non_finite, run_on_hf_stream


@torch.no_grad()
def export_hf_checkpoint(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    model_cfg: MoEModelConfig,
    tokenizer=None,
    *,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    checksums: bool = False,
) -> Path:
    """Write the model as an HF checkpoint directory (collective; rank 0 writes, atomically).

    All ranks walk `stream.iter_hf_tensors` together: tensors are gathered over TP and EP one
    at a time; rank 0 converts each to HF names and hands it to an `HFCheckpointWriter`, which
    writes a safetensors shard to a temp dir as soon as `max_shard_bytes` have accumulated and
    renames the directory into place at the end. Host memory on rank 0 peaks at one shard plus
    one tensor, whatever the model size; the rollout server's `/update_weights_from_disk` never
    sees a partial checkpoint. A NaN/inf weight on any rank is refused before anything is written.

    Args:
        model: This rank's shard (or a DDP wrapper of it).
        out_dir: Destination directory (replaced as a whole).
        model_cfg: Architecture (written to config.json; checked against the model).
        tokenizer: Optional tokenizer saved alongside.
        max_shard_bytes: Safetensors shard size limit (default: `HFCheckpointWriter`'s).
        overwrite: replace an HF model at `out_dir` that was not written by an export.
        checksums: record each file's SHA-256 (`checkpoint.verify_export` checks them).

    Returns:
        The checkpoint path, on every rank, once it is published.

    Raises:
        ConversionError: on every rank, when a weight holds NaN/inf (named): nothing is written
            and the previous export at `out_dir` stays in place for the rollout servers.
    """
    model = unwrap_model(model)
    check_same_architecture(built_architecture(model, model_cfg), model_cfg, "model_cfg")
    kwargs = {"overwrite": overwrite, "checksums": checksums}
    if max_shard_bytes is not None:
        kwargs["max_shard_bytes"] = max_shard_bytes
    refuse_non_finite(model, f"export to {out_dir}")

    def write(stream) -> Path:
        with HFCheckpointWriter(out_dir, model_cfg, tokenizer, **kwargs) as writer:
            for name, tensor in stream:
                writer.add(name, tensor)
            return writer.finish()

    return run_on_hf_stream(model, model_cfg, write)
