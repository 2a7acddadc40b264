"""Rollout routed experts <-> the router's packed token order (position-major, SP slices), for the
mask layout (rows) and the THD layout (one row of padded sequences)."""

import pytest
import torch

from megatron_gspo.model.packing import pack_sequences, pad_to_shape
from megatron_gspo.model.routing import (
    LayerRouting,
    RoutingError,
    RoutingLayerError,
    RoutingLengthError,
    filler_routing,
    index_dtype,
    routing_from_rollout,
    routing_to_samples,
    routing_token_mask,
)

E, LAYERS, K = 16, 3, 2
LENGTHS = [5, 3, 4]


def sample_routes(lengths=LENGTHS):
    """Sample b, position t, layer l -> experts {(b*5 + t + l) % E, (b*5 + t + l + 1) % E}."""
    out = []
    for b, n in enumerate(lengths):
        t = torch.arange(n - 1).view(-1, 1, 1)
        layer = torch.arange(LAYERS).view(1, -1, 1)
        base = b * 5 + t + layer
        out.append((torch.cat([base, base + 1], dim=-1) % E).to(torch.uint8))
    return out


def packed_batch():
    return pack_sequences([torch.arange(1, n + 1) for n in LENGTHS], row_len=8)


def test_position_major_token_order_by_hand():
    packed = packed_batch()
    # First-fit decreasing into rows of 8: sample 0 (5) -> row 0 @0; sample 2 (4) -> row 1 @0;
    # sample 1 (3) -> row 0 @5.
    assert packed.segments == [(0, 0, 5), (0, 5, 3), (1, 0, 4)]
    rows = 2
    routing = routing_from_rollout(packed, sample_routes(), num_experts=E)
    assert routing.num_layers == LAYERS and routing.num_tokens == 8 * rows
    layer1 = routing.as_int64()[1]
    for b, (row, start, n) in enumerate(packed.segments):
        for t in range(n - 1):
            token = (start + t) * rows + row  # position-major: l * R + r
            expected = [(b * 5 + t + 1) % E, (b * 5 + t + 2) % E]
            assert layer1[token].tolist() == expected


def test_last_token_and_padding_get_distinct_filler():
    packed = packed_batch()
    routing = routing_from_rollout(packed, sample_routes(), num_experts=E).stacked()  # [T, layers, k]
    mask = routing_token_mask(packed)
    filler = filler_routing(routing.shape[0], K, E)
    assert torch.equal(routing[~mask], filler[~mask].unsqueeze(1).expand(-1, LAYERS, K))
    assert (routing[..., 0] != routing[..., 1]).all()  # never the same expert twice in a token
    assert int(mask.sum()) == sum(n - 1 for n in LENGTHS)
    load = torch.bincount(filler.reshape(-1), minlength=E)
    assert load.max() - load.min() <= 1  # filler spreads evenly over experts


def test_sequence_parallel_slices_are_contiguous_positions():
    packed = packed_batch()
    full = routing_from_rollout(packed, sample_routes(), num_experts=E).stacked()
    parts = [
        routing_from_rollout(
            packed, sample_routes(), num_experts=E, tp_rank=r, tp_size=2, sequence_parallel=True
        ).stacked()
        for r in range(2)
    ]
    assert parts[0].shape[0] == 8  # (8 / 2) positions x 2 rows
    assert torch.equal(torch.cat(parts), full)
    masks = [routing_token_mask(packed, tp_rank=r, tp_size=2, sequence_parallel=True) for r in range(2)]
    assert torch.equal(torch.cat(masks), routing_token_mask(packed))


def thd_batch(total=None):
    packed = pack_sequences([torch.arange(1, n + 1) for n in LENGTHS], layout="thd", pad_multiple=4)
    return packed if total is None else pad_to_shape(packed, 1, total)


def test_thd_token_order_by_hand():
    packed = thd_batch(total=16)
    # samples in order, padded to 4: offsets 0 (5 tokens -> 8), 8 (3 -> 4), 12 (4 -> 4), tail to 16
    assert packed.cu_seqlens_padded().tolist() == [0, 8, 12, 16]
    routing = routing_from_rollout(packed, sample_routes(), num_experts=E)
    assert routing.num_tokens == 16
    layer1 = routing.as_int64()[1]
    offsets = packed.cu_seqlens_padded().tolist()
    for b, n in enumerate(LENGTHS):
        for t in range(n - 1):
            assert layer1[offsets[b] + t].tolist() == [(b * 5 + t + 1) % E, (b * 5 + t + 2) % E]
    mask = routing_token_mask(packed)
    assert mask.nonzero().squeeze(1).tolist() == [0, 1, 2, 3, 8, 9, 12, 13, 14]
    filler = filler_routing(16, K, E)
    assert torch.equal(routing.stacked()[~mask], filler[~mask].unsqueeze(1).expand(-1, LAYERS, K))


def test_thd_sequence_parallel_slices_and_round_trip():
    packed = thd_batch(total=24)
    full = routing_from_rollout(packed, sample_routes(), num_experts=E).stacked()
    parts = [
        routing_from_rollout(
            packed, sample_routes(), num_experts=E, tp_rank=r, tp_size=4, sequence_parallel=True
        ).stacked()
        for r in range(4)
    ]
    assert [p.shape[0] for p in parts] == [6] * 4  # T / tp contiguous positions per rank
    assert torch.equal(torch.cat(parts), full)
    masks = [routing_token_mask(packed, tp_rank=r, tp_size=4, sequence_parallel=True) for r in range(4)]
    assert torch.equal(torch.cat(masks), routing_token_mask(packed))
    back = routing_to_samples(packed, routing_from_rollout(packed, sample_routes(), num_experts=E))
    assert all(torch.equal(a.long(), b.long()) for a, b in zip(back, sample_routes()))


def test_round_trip_and_layer_subset():
    packed = packed_batch()
    routes = sample_routes()
    back = routing_to_samples(packed, routing_from_rollout(packed, routes, num_experts=E))
    assert all(torch.equal(a.long(), b.long()) for a, b in zip(back, routes))
    sub = routing_from_rollout(packed, routes, num_experts=E, layers=[2])
    back = routing_to_samples(packed, sub)
    assert all(torch.equal(a.long(), b[:, 2:3].long()) for a, b in zip(back, routes))


def test_mismatches_are_named_errors():
    packed = packed_batch()
    routes = sample_routes()
    with pytest.raises(
        RoutingLengthError, match=r"sample 1: 3 routed rows for 3 tokens, expected 2 \(T - 1\)"
    ):
        routing_from_rollout(packed, [routes[0], torch.zeros(3, LAYERS, K), routes[2]], num_experts=E)
    with pytest.raises(RoutingLengthError, match="for 2 samples, the packed batch has 3"):
        routing_from_rollout(packed, routes[:2], num_experts=E)
    with pytest.raises(RoutingLayerError, match=r"sample 2: .* expected \[\*, 3, 2\]"):
        routing_from_rollout(packed, [routes[0], routes[1], routes[2][:, :2]], num_experts=E)
    with pytest.raises(RoutingLayerError, match="outside the 3 layers"):
        routing_from_rollout(packed, routes, num_experts=E, layers=[3])
    with pytest.raises(RoutingError, match=r"ids outside \[0, 8\)"):
        routing_from_rollout(packed, routes, num_experts=8)
    with pytest.raises(RoutingError, match="not divisible by tensor_parallel=3"):
        routing_from_rollout(packed, routes, num_experts=E, tp_rank=0, tp_size=3, sequence_parallel=True)
    with pytest.raises(RoutingLengthError, match="routing covers"):
        routing_to_samples(packed, LayerRouting([torch.zeros(4, K)]))


def test_compact_dtype_and_bytes_per_token():
    assert (
        index_dtype(256) == torch.uint8
        and index_dtype(257) == torch.int16
        and index_dtype(512) == torch.int16
    )
    routing = routing_from_rollout(packed_batch(), sample_routes(), num_experts=E)
    assert routing.layers[0].dtype == torch.uint8
    assert routing.bytes_per_token == LAYERS * K
    assert routing.nbytes == routing.num_tokens * LAYERS * K
