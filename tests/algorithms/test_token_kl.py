"""ROLL's reward-side KL: per-token rewards, reinforce returns and the KL controller, by hand."""

import math

import pytest
import torch

from megatron_gspo.algorithms.token_kl import KLController, token_level_kl_returns


def test_returns_of_the_token_rewards_by_hand():
    # Row 0: 3 tokens, R = 1, kl (k1) = old - ref = 0.1, -0.2, 0.3, beta 0.5:
    #   rewards -0.05, +0.1, -0.15 + 1 -> returns 0.9, 0.95, 0.85. Row 1: 1 token, R = -1, kl 0.4 -> -1.2.
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, 0.0, 0.0]])
    ref = old - torch.tensor([[0.1, -0.2, 0.3], [0.4, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    returns, seq_kl = token_level_kl_returns(torch.tensor([1.0, -1.0]), old, ref, mask, beta=0.5)
    assert returns.flatten().tolist() == pytest.approx([0.9, 0.95, 0.85, -1.2, 0.0, 0.0], abs=1e-6)
    assert seq_kl.tolist() == pytest.approx([0.2 / 3, 0.4], abs=1e-6)
    # k3 and a token reward clip (ROLL clips every token's reward): row 1's -1.2... is -1 - 0.5 k3(0.4).
    k3 = math.exp(-0.4) - 1 + 0.4
    clipped, _ = token_level_kl_returns(torch.tensor([1.0, -1.0]), old, ref, mask, beta=0.5, estimator="k3",
                                        reward_clip=1.0)  # fmt: skip
    assert clipped[1, 0].item() == pytest.approx(-1.0)  # -1 - 0.5 k3 clipped at -1
    assert k3 > 0
    zero, _ = token_level_kl_returns(torch.tensor([1.0, -1.0]), old, old, mask, beta=0.5)
    assert zero.tolist() == [[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]]  # no KL: the reward on every token


def test_reward_clip_applies_to_every_token_reward_before_the_returns():
    # beta 1, k1, clip 0.5 (binary fractions: exact in float).
    # Row 0, R = 1: kl 0.75, -0.625, 0.25, 0.25 -> rewards -0.75, 0.625, -0.25, -0.25 + 1 = 0.75
    #   -> clipped -0.5, 0.5, -0.25, 0.5 -> returns 0.25, 0.75, 0.25, 0.5.
    # Row 1, R = -1, 3 tokens + 1 padding: kl -1, 0.125, 0.5 -> rewards 1, -0.125, -0.5 - 1 = -1.5
    #   -> clipped 0.5, -0.125, -0.5 -> returns -0.125, -0.625, -0.5, and 0 on the padding.
    # Clipping the last token only would give row 0 0.125, 0.875, 0.25, 0.5 and row 1 0.375, -0.625, -0.5.
    kl = torch.tensor([[0.75, -0.625, 0.25, 0.25], [-1.0, 0.125, 0.5, 3.0]])  # 3.0: off the response
    old = torch.full((2, 4), -1.0)
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    returns, seq_kl = token_level_kl_returns(torch.tensor([1.0, -1.0]), old, old - kl, mask, beta=1.0,
                                             reward_clip=0.5)  # fmt: skip
    assert returns.tolist() == [[0.25, 0.75, 0.25, 0.5], [-0.125, -0.625, -0.5, 0.0]]
    assert seq_kl.tolist() == [0.625 / 4, -0.375 / 3]  # the KL itself is not clipped
    unclipped, _ = token_level_kl_returns(torch.tensor([1.0, -1.0]), old, old - kl, mask, beta=1.0)
    assert unclipped.tolist() == [[0.375, 1.125, 0.5, 0.75], [-0.625, -1.625, -1.5, 0.0]]


def test_kl_controllers_as_verl_and_roll():
    fixed = KLController(0.2)
    fixed.update(5.0, 512)
    assert fixed.value == 0.2
    adaptive = KLController(0.2, "adaptive", target_kl=0.01, horizon=10000)
    adaptive.update(0.02, 512)  # error clip(2 - 1, -0.2, 0.2) = 0.2: x (1 + 0.2 x 512 / 10000)
    assert adaptive.value == pytest.approx(0.2 * (1 + 0.2 * 512 / 10000))
    adaptive.update(0.009, 1000)  # error -0.1
    assert adaptive.value == pytest.approx(0.2 * (1 + 0.2 * 512 / 10000) * (1 - 0.1 * 1000 / 10000))
    restored = KLController(0.2, "adaptive", target_kl=0.01)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value
    with pytest.raises(ValueError, match="target_kl > 0"):
        KLController(0.2, "adaptive")
