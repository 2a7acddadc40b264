"""Each loss against values computed by hand with Python's math module."""

import math

import pytest
import torch

from megatron_gspo.algorithms import compute_policy_loss


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_gspo_hand_values_all_branches(token_batch):
    # Row 0: A=+1, mean log-ratio 0.001 -> s above 1+4e-4: clipped high.
    # Row 1: A=-0.5, mean log-ratio -0.0002 -> s inside [1-3e-4, 1+4e-4]: unclipped.
    # Row 2: A=-2, mean log-ratio -0.001 -> s below 1-3e-4: clipped low.
    log_probs, old, mask = token_batch([[0.003, -0.001, 0.001], [-0.0005, 0.0001], [-0.002, 0.0, -0.001]])
    adv = torch.tensor([1.0, -0.5, -2.0], dtype=torch.float64)
    loss, metrics = compute_policy_loss("gspo", log_probs, old, adv, mask)

    s1 = math.exp(-0.0002)
    per_response = [-1.0 * (1 + 4e-4), 0.5 * s1, 2.0 * (1 - 3e-4)]
    assert loss.item() == pytest.approx(sum(per_response) / 3, abs=1e-12)

    loss.backward()
    expected_grad = torch.zeros(3, 3, dtype=torch.float64)
    # d/dlogp_t of (1/3) * (-A s) with s = exp(mean_t logratio): (1/3) * 0.5 * s / 2 per token.
    expected_grad[1, :2] = 0.5 * s1 / 2 / 3
    torch.testing.assert_close(log_probs.grad, expected_grad, rtol=0, atol=1e-12)

    assert metrics["actor/clipfrac_seq_high"].item() == pytest.approx(1 / 3)
    assert metrics["actor/clipfrac_seq_low"].item() == pytest.approx(1 / 3)
    assert metrics["actor/clipfrac_seq"].item() == pytest.approx(2 / 3)
    assert metrics["actor/clipfrac_tokens_high"].item() == pytest.approx(3 / 8)
    assert metrics["actor/clipfrac_tokens_low"].item() == pytest.approx(3 / 8)
    assert metrics["actor/clipfrac_tokens"].item() == pytest.approx(6 / 8)
    ratios = [math.exp(0.001), s1, math.exp(-0.001)]
    assert metrics["actor/ratio_mean"].item() == pytest.approx(sum(ratios) / 3, abs=1e-7)
    assert metrics["actor/ratio_min"].item() == pytest.approx(min(ratios), abs=1e-7)
    assert metrics["actor/ratio_max"].item() == pytest.approx(max(ratios), abs=1e-7)
    assert metrics["actor/masked_out_frac"].item() == pytest.approx(1 / 9)


def test_gspo_token_hand_values_per_token_advantages(token_batch):
    # One response, mean log-ratio 0.001: s = e^0.001 > 1 + 4e-4. Per-token advantages
    # [+1, -1, +2]: the A>0 tokens are clipped high, the A<0 token is not.
    log_probs, old, mask = token_batch([[0.002, 0.0, 0.001]])
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    loss, metrics = compute_policy_loss("gspo_token", log_probs, old, adv, mask)
    s = math.exp(0.001)
    per_token = [-1.0 * (1 + 4e-4), 1.0 * s, -2.0 * (1 + 4e-4)]
    assert loss.item() == pytest.approx(sum(per_token) / 3, abs=1e-12)
    loss.backward()
    # Only the A<0 token has gradient: d(-A s_it)/dlogp = -A * s, over 3 tokens.
    expected = torch.tensor([[0.0, s / 3, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(log_probs.grad, expected, rtol=0, atol=1e-12)
    assert metrics["actor/clipfrac_tokens_high"].item() == pytest.approx(2 / 3)
    assert metrics["actor/clipfrac_seq_high"].item() == 1.0
    assert metrics["actor/ratio_mean"].item() == pytest.approx(s, abs=1e-7)


@pytest.mark.parametrize("dual", [False, True])
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_grpo_hand_values(token_batch, dual, mode):
    ratios = [[1.5, 1.1, 0.5], [0.7, 1.1, 5.0]]
    log_probs, old, mask = token_batch([[math.log(r) for r in row] for row in ratios])
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    options = {"clip_ratio_c": 3.0} if dual else {}
    loss, metrics = compute_policy_loss("grpo", log_probs, old, adv, mask, loss_agg_mode=mode, **options)

    # A=+2: r=1.5 clipped to 1.27; 1.1 unclipped; 0.5 unclipped (min picks 0.5 A).
    # A=-1: r=0.7 clipped to 0.8; 1.1 unclipped; 5.0 unclipped, or capped at c|A| = 3 by dual clip.
    row0 = [-2 * 1.27, -2 * 1.1, -2 * 0.5]
    row1 = [0.8, 1.1, 3.0 if dual else 5.0]
    if mode == "token-mean":
        expected = (sum(row0) + sum(row1)) / 6
        scale = [1 / 6, 1 / 6]
    else:
        expected = (sum(row0) / 3 + sum(row1) / 3) / 2
        scale = [1 / 6, 1 / 6]
    assert loss.item() == pytest.approx(expected, abs=1e-12)

    loss.backward()
    # Unclipped branch gradient: d(-A r)/dlogp = -A r.
    grad_row0 = [0.0, -2 * 1.1 * scale[0], -2 * 0.5 * scale[0]]
    grad_row1 = [0.0, 1.1 * scale[1], 0.0 if dual else 5.0 * scale[1]]
    torch.testing.assert_close(
        log_probs.grad, torch.tensor([grad_row0, grad_row1], dtype=torch.float64), rtol=0, atol=1e-12
    )

    assert metrics["actor/clipfrac_tokens_low"].item() == pytest.approx(1 / 6)
    assert metrics["actor/clipfrac_tokens_high"].item() == pytest.approx((2 if dual else 1) / 6)
    assert metrics["actor/clipfrac_seq_low"].item() == pytest.approx(0.5)
    assert metrics["actor/clipfrac_seq_high"].item() == pytest.approx(1.0 if dual else 0.5)
    if dual:
        assert metrics["actor/clipfrac_dual_tokens"].item() == pytest.approx(1 / 6)
    else:
        assert "actor/clipfrac_dual_tokens" not in metrics
    flat = [r for row in ratios for r in row]
    logs = [math.log(r) for r in flat]
    mean_log = sum(logs) / 6
    assert metrics["actor/ratio_mean"].item() == pytest.approx(sum(flat) / 6, rel=1e-6)
    assert metrics["actor/ratio_min"].item() == pytest.approx(0.5, rel=1e-6)
    assert metrics["actor/ratio_max"].item() == pytest.approx(5.0, rel=1e-6)
    assert metrics["actor/log_ratio_std"].item() == pytest.approx(
        math.sqrt(sum((x - mean_log) ** 2 for x in logs) / 6), rel=1e-6
    )
    # k3 of KL(old || new) with r = new/old: (r - 1) - log r.
    assert metrics["actor/approx_kl"].item() == pytest.approx(
        sum(r - 1 - math.log(r) for r in flat) / 6, rel=1e-6
    )
    assert metrics["actor/pg_loss"].item() == pytest.approx(expected, abs=1e-6)


def test_grpo_asymmetric_defaults_are_0_2_and_0_27(token_batch):
    # A>0 at r=1.26 is inside (not clipped), at r=1.28 outside; A<0 at r=0.81 inside, 0.79 outside.
    log_probs, old, mask = token_batch([[math.log(1.26), math.log(1.28)], [math.log(0.81), math.log(0.79)]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    _, metrics = compute_policy_loss("grpo", log_probs, old, adv, mask)
    assert metrics["actor/clipfrac_tokens_high"].item() == pytest.approx(1 / 4)
    assert metrics["actor/clipfrac_tokens_low"].item() == pytest.approx(1 / 4)


def test_sapo_hand_values(token_batch):
    ratios = [[1.0, 2.0], [0.5, 1.0]]
    log_probs, old, mask = token_batch([[math.log(r) for r in row] for row in ratios])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, metrics = compute_policy_loss("sapo", log_probs, old, adv, mask)

    def gate(r, tau):
        return sigmoid(tau * (r - 1)) * 4 / tau

    row0 = [-gate(1.0, 1.0), -gate(2.0, 1.0)]
    row1 = [gate(0.5, 1.05), gate(1.0, 1.05)]
    assert loss.item() == pytest.approx((sum(row0) / 2 + sum(row1) / 2) / 2, abs=1e-12)

    loss.backward()

    def grad(r, tau, a):
        # d(-f(r) A)/dlogp = -A * 4 p (1 - p) * r, with p = sigmoid(tau (r - 1)).
        p = sigmoid(tau * (r - 1))
        return -a * 4 * p * (1 - p) * r / 4  # / (2 tokens * 2 responses)

    expected = [[grad(1.0, 1.0, 1.0), grad(2.0, 1.0, 1.0)], [grad(0.5, 1.05, -1.0), grad(1.0, 1.05, -1.0)]]
    torch.testing.assert_close(
        log_probs.grad, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12
    )
    # On-policy the gradient weight is exactly 1 (times A).
    assert log_probs.grad[0, 0].item() == pytest.approx(-1 / 4)
    weights = [
        4 * sigmoid(t * (r - 1)) * (1 - sigmoid(t * (r - 1)))
        for r, t in [(1, 1), (2, 1), (0.5, 1.05), (1, 1.05)]
    ]
    assert metrics["actor/sapo_gate_weight"].item() == pytest.approx(sum(weights) / 4, rel=1e-6)
    assert metrics["actor/clipfrac_tokens"].item() == 0.0


def test_sapo_custom_temperatures_and_log_ratio_clamp(token_batch):
    # A log-ratio of 50 is clamped to 5: the gate saturates near 4 / tau and no gradient flows.
    log_probs, old, mask = token_batch([[50.0, 0.2]])
    adv = torch.tensor([1.5], dtype=torch.float64)
    loss, _ = compute_policy_loss(
        "sapo", log_probs, old, adv, mask, tau_pos=2.0, tau_neg=3.0, log_ratio_clamp=5.0
    )
    r0, r1 = math.exp(5.0), math.exp(0.2)
    expected = -1.5 * (sigmoid(2 * (r0 - 1)) * 2 + sigmoid(2 * (r1 - 1)) * 2) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    loss.backward()
    assert log_probs.grad[0, 0].item() == 0.0
    assert torch.isfinite(log_probs.grad).all()


@pytest.mark.parametrize("loss_type", ["grpo", "gspo", "gspo_token", "sapo"])
def test_bf16_inputs_are_computed_in_float32(token_batch, loss_type):
    """The exact reference: the fp32 loss of the bf16-rounded inputs (bf16 arithmetic is ~1e-3 off)."""
    generator = torch.Generator().manual_seed(0)
    log16 = (-3 * torch.rand(2, 5, generator=generator)).bfloat16()  # log-probs of varied magnitude
    old16 = (log16.float() + 0.05 * torch.randn(2, 5, generator=generator)).bfloat16()
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    adv = torch.tensor([1.0, -0.5])
    loss16, _ = compute_policy_loss(loss_type, log16, old16, adv, mask)
    reference, _ = compute_policy_loss(loss_type, log16.float(), old16.float(), adv, mask)
    assert loss16.dtype == torch.float32
    assert loss16.item() == pytest.approx(reference.item(), rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("loss_type", ["gspo", "gspo_token"])
def test_gspo_dual_clip_caps_negative_advantage_responses_as_roll(loss_type):
    # ROLL: loss = -max(-loss, c A) for A < 0 with c = 1 + 2 x 0.2 = 1.4, on GSPO's sequence ratio.
    # Response 0: s = e^0.5 ~ 1.65, A = -1: PPO loss max(1.65, 1.0003) = 1.65 > 1.4, capped to 1.4.
    # Response 1: s = e^0.1, A = -1: 1.105 < 1.4, untouched. Response 2: A = +1, no dual clip.
    log_probs = torch.tensor(
        [[-0.5, -0.5], [-0.9, -0.9], [-0.5, -0.5]], dtype=torch.float64, requires_grad=True
    )
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    adv = torch.tensor([-1.0, -1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(3, 2, dtype=torch.bool)
    loss, metrics = compute_policy_loss(
        loss_type, log_probs, old, adv, mask, loss_agg_mode="seq-mean-token-mean", clip_ratio_c=1.4
    )
    expected = (1.4 + math.exp(0.1) + -(1 + 4e-4)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["actor/clipfrac_dual_tokens"].item() == pytest.approx(2 / 6)
    loss.backward()
    assert log_probs.grad[0].abs().max().item() == 0.0  # the cap is constant: no gradient
    assert log_probs.grad[1].abs().min().item() > 0.0
