"""Sorted-greedy balanced partition: hand cases, the one-item bound, sizes, determinism, errors."""

import random

import pytest

from megatron_gspo.training.step.balance import balanced_partition


def totals(weights, parts):
    return [sum(weights[i] for i in part) for part in parts]


def test_hand_cases():
    # 8 -> A; 7 -> B; 6 -> B (7 < 8); 5 -> A (8 < 13); 4 -> A (13 = 13, 2 items each: the first part).
    # (Greedy, not optimal: 8 + 7 | 6 + 5 + 4 would be 15 | 15.)
    assert balanced_partition([5, 8, 4, 7, 6], 2) == [[0, 1, 2], [3, 4]]
    assert totals([5, 8, 4, 7, 6], balanced_partition([5, 8, 4, 7, 6], 2)) == [17, 13]
    # One heavy item against many light ones: the heavy one stays alone.
    assert balanced_partition([10, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]
    # As many parts as items: one item each.
    assert balanced_partition([3, 1, 2], 3) == [[0], [2], [1]]
    # Zero weights still fill every part (fewest items breaks the tie).
    assert balanced_partition([0, 0, 0, 0], 2) == [[0, 2], [1, 3]]


def test_equal_size_hand_case():
    # Unconstrained: [[9], [1, 1, 1]]; two items each: 9 -> A, 1 -> B, 1 -> B (full), 1 -> A.
    assert balanced_partition([9, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert balanced_partition([9, 1, 1, 1], 2, equal_size=True) == [[0, 3], [1, 2]]


@pytest.mark.parametrize("seed", range(5))
def test_random_weights_differ_by_at_most_one_item(seed):
    rng = random.Random(seed)
    weights = [int(rng.lognormvariate(6, 1)) for _ in range(rng.randint(8, 200))]
    parts = rng.randint(2, 8)
    out = balanced_partition(weights, parts)
    assert sorted(i for part in out for i in part) == list(range(len(weights)))
    assert all(part for part in out) and all(part == sorted(part) for part in out)
    sums = totals(weights, out)
    assert max(sums) - min(sums) <= max(weights)
    # Far better than the strided assignment the count-based cut makes.
    strided = totals(weights, [list(range(p, len(weights), parts)) for p in range(parts)])
    assert max(sums) - min(sums) <= max(strided) - min(strided)
    assert balanced_partition(list(weights), parts) == out  # deterministic


def test_equal_size_keeps_counts():
    rng = random.Random(3)
    weights = [rng.randint(1, 1000) for _ in range(24)]
    out = balanced_partition(weights, 4, equal_size=True)
    assert [len(part) for part in out] == [6] * 4
    assert sorted(i for part in out for i in part) == list(range(24))


def test_errors():
    with pytest.raises(ValueError, match=r"cannot split 2 item\(s\) into 3 non-empty part"):
        balanced_partition([1, 2], 3)
    with pytest.raises(ValueError, match="into 0 non-empty"):
        balanced_partition([1, 2], 0)
    with pytest.raises(ValueError, match="5 items do not split into 2 parts of equal size"):
        balanced_partition([1] * 5, 2, equal_size=True)
