"""drift.sample_tokens: a deterministic every-k-th sample of the routed tokens."""

import torch

from megatron_gspo.training.step.routing import every_kth, sample_stride


def test_every_kth_keeps_every_kth_true_entry():
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    # True at 1, 2, 4, 5, 6, 8 -> keep the 1st, 3rd, 5th of them: 1, 4, 6
    assert every_kth(mask, 2).nonzero().flatten().tolist() == [1, 4, 6]
    assert torch.equal(every_kth(mask, 1), mask)
    assert every_kth(mask, 100).nonzero().flatten().tolist() == [1]


def test_sample_stride_bounds_the_count():
    assert sample_stride(1000, 0) == 1  # 0: all tokens
    assert sample_stride(1000, 5000) == 1
    for tokens, budget in [(1000, 64), (1001, 10), (7, 3), (8_000_000, 65_536)]:
        k = sample_stride(tokens, budget)
        assert -(-tokens // k) <= budget < -(-tokens // max(k - 1, 1)) or k == 1
