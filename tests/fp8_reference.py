"""An independent float64 blockwise-FP8 reference for the quantiser and weight-sync tests.

Importable from every test directory: `tests/` is on sys.path through its conftest.py.
"""

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn


def reference_quantize(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128x128 block (ragged at the edges): scale_inv = amax / 448 in float64, q = w / scale_inv.

    The float64 quotient is rounded to float32 before FP8 (exact: float64 carries more than
    twice float32's precision, so this equals float32's correctly rounded quotient).
    """
    w = weight.double()
    rows, cols = w.shape
    scales = torch.empty(math.ceil(rows / block), math.ceil(cols / block), dtype=torch.float64)
    q = torch.empty(rows, cols, dtype=FP8_DTYPE)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            amax = part.abs().max().item()
            scale = amax / 448.0 if amax > 0 else 1.0
            scales[i, j] = scale
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (
                (part / torch.tensor(scale, dtype=torch.float32).double()).float().to(FP8_DTYPE)
            )
    return q, scales.float()


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """q * scale_inv per block, in float64 (exact)."""
    full = scale.double().repeat_interleave(block, 0).repeat_interleave(block, 1)[: q.shape[0], : q.shape[1]]
    return q.double() * full
