"""Blockwise FP8 (e4m3) weights for the rollout engine, in the published Qwen3-*-FP8 layout.

Those checkpoints (`quantization_config: {quant_method: fp8, fmt: e4m3, activation_scheme:
dynamic, weight_block_size: [128, 128]}`) store each decoder linear weight `X.weight` as
float8_e4m3fn next to a float32 `X.weight_scale_inv` of shape [ceil(rows/128), ceil(cols/128)]:
per 128x128 block, scale_inv = amax(|block|) / 448 and the served value is fp8 * scale_inv.
Edge blocks of a shape not divisible by 128 are ragged (their amax is over the real entries),
as SGLang's block loader expects. Embeddings, lm_head, norms and the router gates stay in the
trainer's dtype. The sender quantises tensor by tensor as the weights stream out; the embedded
server turns each pair back into one dequantised tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from megatron_gspo.model.fp8.serving import BLOCK

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
"""The `quantization_config` of an HF config.json whose weights are in this layout."""

# Decoder linear weights: attention q/k/v/o and every MLP / expert / shared-expert projection.
# `mlp.gate.weight` (router) and `shared_expert_gate.weight` do not end in `_proj.weight`.
_QUANTIZED = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether HF tensor `name` travels as FP8 (a 2-D decoder projection weight)."""
    return tensor.dim() == 2 and _QUANTIZED.match(name) is not None


def _padded_blocks(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    rows, cols = tensor.shape
    row_blocks, col_blocks = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.nn.functional.pad(tensor, (0, col_blocks * BLOCK - cols, 0, row_blocks * BLOCK - rows))
    return padded.view(row_blocks, BLOCK, col_blocks, BLOCK), row_blocks, col_blocks


def quantize_blockwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 values and float32 per-block scale_inv of a 2-D weight (on its device).

    Zero padding of the ragged edge blocks does not change their amax; an all-zero block
    gets scale 1 (any scale reproduces its zeros).
    """
    if weight.dim() != 2:
        raise ValueError(f"blockwise FP8 needs a 2-D weight, got shape {list(weight.shape)}")
    rows, cols = weight.shape
    blocks, _, _ = _padded_blocks(weight.detach().float())
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = blocks / scale_inv[:, None, :, None]
    fp8 = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    fp8 = fp8.reshape(blocks.shape[0] * BLOCK, blocks.shape[2] * BLOCK)[:rows, :cols].contiguous()
    return fp8, scale_inv


def dequantize_blockwise(fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp8 * scale_inv per 128x128 block, in float32."""
    rows, cols = fp8.shape
    expected = [-(-rows // BLOCK), -(-cols // BLOCK)]
    if list(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv shape {list(scale_inv.shape)} does not fit weight {[rows, cols]}: {expected}"
        )
    scale = scale_inv.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return fp8.float() * scale


def quantize_stream(named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensor stream with each decoder projection as (`X.weight` fp8, `X.weight_scale_inv`)."""
    for name, tensor in named:
        if is_quantized(name, tensor):
            fp8, scale_inv = quantize_blockwise(tensor)
            yield name, fp8
            yield name + SCALE_SUFFIX, scale_inv
        else:
            yield name, tensor


def dequantize_named(
    named: dict[str, torch.Tensor], pending: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Tensors of one received bucket with every FP8 weight replaced by its dequantised value.

    A weight and its scale may arrive in different buckets: the half whose partner has not
    come yet waits in `pending` (the caller refuses a session that ends with one waiting).

    Raises:
        ValueError: an FP8 tensor that is not a projection weight, or a scale of the wrong shape.
    """
    out = {}
    for name, tensor in named.items():
        if name.endswith(SCALE_SUFFIX) or tensor.dtype == FP8_DTYPE:
            if tensor.dtype == FP8_DTYPE and not _QUANTIZED.match(name):
                raise ValueError(f"{name}: FP8 is only accepted for decoder projection weights")
            pending[name] = tensor
        else:
            out[name] = tensor
    for name in [n for n in pending if not n.endswith(SCALE_SUFFIX)]:
        scale = pending.get(name + SCALE_SUFFIX)
        if scale is not None:
            out[name] = dequantize_blockwise(pending.pop(name), pending.pop(name + SCALE_SUFFIX))
    return out
