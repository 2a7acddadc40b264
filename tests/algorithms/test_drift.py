"""Drift metrics against hand-computed values."""

import pytest
import torch

from megatron_gspo.algorithms.drift import DriftCounts, drift_counts, expert_load, routing_drift, topk_overlap

# 3 tokens, 2 layers, k = 2, 4 experts.
A = torch.tensor(
    [
        [[0, 1], [2, 3]],
        [[1, 2], [0, 3]],
        [[0, 3], [1, 2]],
    ]
)
B = torch.tensor(
    [
        [[1, 0], [2, 3]],  # same sets (order differs)
        [[1, 3], [0, 3]],  # layer 0: one of two changed
        [[1, 2], [2, 1]],  # layer 0: both changed; layer 1 same set
    ]
)


def test_overlap_ignores_order():
    assert topk_overlap(A, B).tolist() == [[2, 2], [1, 2], [0, 2]]


def test_hand_computed_drift():
    s = routing_drift(A, B, num_experts=4)
    # layer 0: (0 + 0.5 + 1) / 3; layer 1: 0
    assert s.per_layer.tolist() == pytest.approx([0.5, 0.0])
    assert s.mean == pytest.approx(0.25)
    assert s.tokens_changed == pytest.approx(2 / 3)
    # layer 0 loads: a = {0:2, 1:2, 2:1, 3:1} / 6; b = {0:1, 1:3, 2:1, 3:1} / 6 -> L1 = 2/6
    assert s.load_shift.tolist() == pytest.approx([1 / 3, 0.0])
    assert s.num_tokens == 3


def test_mask_excludes_tokens():
    s = routing_drift(A, B, num_experts=4, mask=torch.tensor([True, True, False]))
    assert s.per_layer.tolist() == pytest.approx([0.25, 0.0])
    assert s.tokens_changed == pytest.approx(0.5)


def test_counts_add_and_roundtrip_through_one_tensor():
    whole = drift_counts(A, B, num_experts=4)
    parts = drift_counts(A[:1], B[:1], num_experts=4) + drift_counts(A[1:], B[1:], num_experts=4)
    flat = parts.as_tensor()
    back = DriftCounts.from_tensor(flat, num_layers=2, num_experts=4)
    for x, y in zip(whole.as_tuple(), back.as_tuple()):
        assert torch.equal(x.double(), y.double())
    assert back.summary().per_layer.tolist() == pytest.approx([0.5, 0.0])


def test_identical_routing_has_zero_drift_and_disjoint_has_one():
    assert routing_drift(A, A, num_experts=4).mean == 0.0
    disjoint = (A + 2) % 4  # {0,1}->{2,3}, {2,3}->{0,1}, {1,2}->{3,0}, {0,3}->{2,1}
    s = routing_drift(A, disjoint, num_experts=4)
    assert s.per_layer.tolist() == pytest.approx([1.0, 1.0]) and s.tokens_changed == 1.0


def test_expert_load_counts():
    load = expert_load(A, 4)
    assert load.tolist() == [[2, 2, 1, 1], [1, 1, 2, 2]]


def test_metrics_keys():
    m = routing_drift(A, B, num_experts=4).metrics("drift/old_new")
    assert m["drift/old_new/layer_0"] == pytest.approx(0.5)
    assert set(m) == {
        "drift/old_new/mean",
        "drift/old_new/tokens_changed",
        "drift/old_new/layer_0",
        "drift/old_new/layer_1",
        "drift/old_new/load_shift_mean",
    }


def test_bad_shapes_named():
    with pytest.raises(ValueError, match="routings must both be"):
        routing_drift(A, B[:2], num_experts=4)
    with pytest.raises(ValueError, match="mask shape"):
        routing_drift(A, B, num_experts=4, mask=torch.ones(2, dtype=torch.bool))
