"""Blockwise FP8 quantiser against the float64 per-block reference of tests/fp8_reference.py."""

import math

import pytest
import torch
from fp8_reference import reference_quantize

from megatron_gspo.model.fp8.blockwise import (
    FP8_DTYPE,
    dequantize_blockwise,
    dequantize_named,
    is_quantized,
    quantize_blockwise,
    quantize_stream,
)


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (7, 130), (128, 1)])
def test_quantiser_matches_the_float64_reference_bit_for_bit_on_ragged_shapes(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen) * 3).to(torch.bfloat16)
    weight[:5, :5] = 0  # partly zero block
    fp8, scale_inv = quantize_blockwise(weight)
    ref_q, ref_scale = reference_quantize(weight)
    assert fp8.dtype == FP8_DTYPE and scale_inv.dtype == torch.float32
    assert list(scale_inv.shape) == [math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)]
    assert torch.equal(scale_inv, ref_scale)
    assert torch.equal(fp8.view(torch.uint8), ref_q.view(torch.uint8))
    # Round trip: e4m3 keeps 3 mantissa bits, so |error| <= 2^-4 relative to the value, plus the
    # subnormal floor (2^-10 of the block scale) for the smallest values.
    back = dequantize_blockwise(fp8, scale_inv).double()
    scale_full = (
        ref_scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    )
    bound = weight.double().abs() * 2**-4 + scale_full * 2**-10
    assert ((back - weight.double()).abs() <= bound).all()
    assert (back != weight.double()).any()  # the quantisation really happened
    # Each block's largest entry maps onto the top of the FP8 range.
    assert fp8.float().abs().max() == 448.0


def test_an_all_zero_weight_round_trips_to_zeros():
    fp8, scale_inv = quantize_blockwise(torch.zeros(130, 5))
    assert torch.equal(dequantize_blockwise(fp8, scale_inv), torch.zeros(130, 5))
    assert torch.equal(scale_inv, torch.ones(2, 1))


def test_which_tensors_stay_unquantised():
    """As the Qwen3-*-FP8 checkpoints: decoder projections only; router gate, norms, embeddings and
    lm_head stay in the trainer's dtype."""
    matrix, vector = torch.ones(4, 4), torch.ones(4)
    quantized = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.3.mlp.experts.7.gate_proj.weight",
        "model.layers.3.mlp.experts.7.down_proj.weight",
        "model.layers.1.mlp.shared_expert.up_proj.weight",
    ]
    kept = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.shared_expert_gate.weight",
    ]
    assert all(is_quantized(n, matrix) for n in quantized)
    assert not any(is_quantized(n, matrix) for n in kept)
    assert not is_quantized("model.layers.0.input_layernorm.weight", vector)
    assert not is_quantized("model.layers.0.self_attn.q_norm.weight", vector)
    named = list(quantize_stream(iter([(quantized[0], matrix), (kept[0], matrix)])))
    assert [n for n, _ in named] == [quantized[0], quantized[0] + "_scale_inv", kept[0]]
    assert [t.dtype for _, t in named] == [FP8_DTYPE, torch.float32, torch.float32]


def test_receiver_pairs_a_weight_and_its_scale_across_buckets():
    name = "model.layers.0.self_attn.q_proj.weight"
    weight = torch.randn(200, 140)
    fp8, scale_inv = quantize_blockwise(weight)
    pending = {}
    assert dequantize_named({"model.norm.weight": torch.ones(3), name: fp8}, pending).keys() == {
        "model.norm.weight"
    }
    out = dequantize_named({name + "_scale_inv": scale_inv}, pending)
    assert not pending and torch.equal(out[name], dequantize_blockwise(fp8, scale_inv))
    with pytest.raises(ValueError, match="model.norm.weight: FP8 is only accepted"):
        dequantize_named({"model.norm.weight": fp8}, {})
    with pytest.raises(ValueError, match="does not fit weight"):
        dequantize_named({name: fp8, name + "_scale_inv": torch.ones(1, 1)}, {})
