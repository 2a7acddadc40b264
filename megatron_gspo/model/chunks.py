"""This rank's model chunks under a virtual pipeline (`parallel.virtual_pipeline`).

With V chunks per pipeline stage megatron builds V `GPTModel`s per rank (`vp_stage` 0..V-1):
chunk c of stage s holds its own slice of the layers, the embedding sits in chunk 0 of the first
stage and the output layer in chunk V-1 of the last, and the interleaved schedule takes the list
of chunks. `ModelChunks` holds them as one module (so the parameters, `.to()`, `train()` and
`eval()` reach every chunk) and `model_chunks` turns any policy into the list megatron's schedule,
DDP finalisation and optimizer want: the chunks, or `[model]` without a virtual pipeline.
"""

from __future__ import annotations

import torch


class ModelChunks(torch.nn.ModuleList):
    """The V model chunks of this pipeline stage, in `vp_stage` order."""

    @property
    def config(self):
        """The megatron `TransformerConfig` (shared by the chunks)."""
        return self[0].config

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        """Tied embeddings (the same in every chunk)."""
        return _gpt(self[0]).share_embeddings_and_output_weights

    @property
    def vocab_size(self) -> int:
        """The vocabulary as built (megatron's TP padding included)."""
        return _gpt(self[0]).vocab_size

    @property
    def unpadded_vocab_size(self) -> int:
        """The real vocabulary (`builder.unpadded_vocab_size`)."""
        return _gpt(self[0]).unpadded_vocab_size

    def zero_grad_buffer(self) -> None:
        """Clear every chunk's DDP grad buffers."""
        for chunk in self:
            chunk.zero_grad_buffer()


def model_chunks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The chunks of `model` in order: `ModelChunks`' members, else `[model]`."""
    return list(model) if isinstance(model, ModelChunks) else [model]


def _gpt(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):  # DDP / Float16Module wrappers
        module = module.module
    return module
