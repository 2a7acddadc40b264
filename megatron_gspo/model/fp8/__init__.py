"""Blockwise FP8 weights for the rollout engine.

- `blockwise`: quantise and dequantise in the published Qwen3-*-FP8 layout (128 x 128 blocks);
- `serving`: whether real SGLang can serve them from a checkpoint at a layout, refused by name.
"""

from megatron_gspo.lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Fp8ServingError": "serving",
        "check_fp8_serving": "serving",
        "dequantize_blockwise": "blockwise",
        "quantize_blockwise": "blockwise",
        "quantize_stream": "blockwise",
    },
)
__all__ = __dir__()
