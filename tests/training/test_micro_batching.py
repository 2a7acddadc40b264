"""Cutting a batch into per-rank micro-batches: by count (strided) and by a token budget."""

import random

import pytest
import torch

from megatron_gspo.model.packing import pack_sequences, packed_size
from megatron_gspo.training.step.micro_batches import (
    DataLayout,
    dp_rows,
    flatten,
    split_batch,
    split_by_tokens,
)


def long_tailed(n, seed, low=20, high=3200):
    rng = random.Random(seed)
    return [min(high, max(low, int(rng.lognormvariate(5.5, 1.0)))) for _ in range(n)]


@pytest.mark.parametrize("layout,pad", [("thd", 1), ("thd", 4), ("mask", 1), ("mask", 4)])
def test_packed_size_is_what_packing_allocates(layout, pad):
    rng = random.Random(0)
    for _ in range(20):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 9))]
        packed = pack_sequences([torch.ones(n) for n in lengths], layout=layout, pad_multiple=pad)
        assert packed_size(lengths, layout=layout, pad_multiple=pad) == packed.tokens.numel()
    # By hand: THD pads each sample to 4 (8 + 4 + 4); mask rows of the longest (7 -> 8): [7], [3, 2].
    assert packed_size([7, 3, 2], layout="thd", pad_multiple=4) == 16
    assert packed_size([7, 3, 2], layout="mask", pad_multiple=4) == 16
    assert packed_size([7, 3, 2], layout="mask", pad_multiple=1) == 14


def test_count_split_is_the_strided_cut():
    lengths = list(range(1, 17))
    layout = DataLayout(dp_size=2, micro_batch_size=3)
    splits = split_batch(lengths, 2, layout)
    assert splits[1] == [[[1, 3, 5], [7]], [[9, 11, 13], [15]]]
    for r in range(2):
        rows, sizes = flatten(splits[r])
        assert rows == dp_rows(16, 2, r, 2) and sizes == [[3, 1], [3, 1]]
    whole = split_batch(lengths, 2, DataLayout(dp_size=2))
    assert whole[0] == [[[0, 2, 4, 6]], [[8, 10, 12, 14]]]


def test_token_split_hand_case():
    cost = DataLayout(packing="thd").cost  # no padding: a micro-batch costs its tokens
    # Lengths 12, 7, 6, 5 (30 tokens), budget 12, 2 ranks: at least 3 micro-batches, rounded up to
    # 4 (a multiple of 2): one row each; the ranks take 12 + 5 and 7 + 6, the costlier first.
    assert split_by_tokens([12, 7, 6, 5], 2, 12, cost) == [[[0], [3]], [[1], [2]]]
    # Budget 18: 2 micro-batches, greedy 12 + 5 = 17 and 7 + 6 = 13, one per rank.
    assert split_by_tokens([12, 7, 6, 5], 2, 18, cost) == [[[0, 3]], [[1, 2]]]


def test_token_split_adds_micro_batches_until_every_one_fits():
    cost = DataLayout(packing="thd").cost
    # 7, 7, 5, 5 under 12: two micro-batches of 7 + 5 fit exactly.
    assert split_by_tokens([7, 7, 5, 5], 1, 12, cost) == [[[0, 2], [1, 3]]]
    # 9, 8, 7 (24) under 12: greedy into 2 gives 9 | 8 + 7 = 15 > 12, so 3 micro-batches.
    assert split_by_tokens([9, 8, 7], 1, 12, cost) == [[[0], [1], [2]]]


@pytest.mark.parametrize("packing,pad", [("thd", 1), ("thd", 8), ("mask", 1), ("mask", 8)])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_token_split_properties(packing, pad, dp):
    lengths = long_tailed(64, seed=dp)
    layout = DataLayout(dp_size=dp, pad_multiple=pad, packing=packing, max_tokens_per_micro_batch=4096)
    splits = split_batch(lengths, 2, layout)
    assert len(splits) == dp
    seen = []
    for m in range(2):
        counts = {len(split[m]) for split in splits}
        assert len(counts) == 1  # every rank the same number of micro-batches
        for split in splits:
            for micro in split[m]:
                assert micro and micro == sorted(micro)
                assert all(32 * m <= i < 32 * (m + 1) for i in micro)  # rows stay in their mini-batch
                assert layout.cost([lengths[i] for i in micro]) <= 4096
                seen += micro
    assert sorted(seen) == list(range(64))
    assert split_batch(list(lengths), 2, layout) == splits  # deterministic


def test_token_split_balances_ranks_better_than_the_strided_cut():
    lengths = long_tailed(256, seed=7)
    budget = 8192
    strided = split_batch(lengths, 1, DataLayout(dp_size=4, micro_batch_size=8))
    balanced = split_batch(
        lengths, 1, DataLayout(dp_size=4, max_tokens_per_micro_batch=budget, packing="thd")
    )

    def imbalance(splits):
        sums = [sum(lengths[i] for i in flatten(split)[0]) for split in splits]
        return max(sums) / min(sums)

    assert imbalance(balanced) < 1.05 < imbalance(strided)


def test_a_row_over_the_budget_is_named():
    # 99 tokens pad to 104 positions under a multiple of 8: over a budget of 100.
    layout = DataLayout(dp_size=2, max_tokens_per_micro_batch=100, pad_multiple=8, packing="thd")
    message = (
        r"a row of 99 tokens \(prompt \+ response; 104 positions packed\) exceeds "
        r"trainer.max_tokens_per_micro_batch=100"
    )
    with pytest.raises(ValueError, match=message):
        split_batch([10, 99, 20, 30], 1, layout)
    layout.pad_multiple = 4  # 99 -> 100 positions: fits exactly, alone
    assert any([1] in split[0] for split in split_batch([10, 99, 20, 30], 1, layout))


def test_rows_that_do_not_split_over_ranks():
    with pytest.raises(ValueError, match="6 responses do not split into 1 mini-batches x 4"):
        split_batch([5] * 6, 1, DataLayout(dp_size=4, max_tokens_per_micro_batch=100))
