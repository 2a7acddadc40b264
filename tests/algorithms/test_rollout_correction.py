"""Rollout correction (TIS, MIS, IcePop) and its composition with GRPO / GSPO, against hand values.

`token_batch` gives (log pi_theta, log pi_old, mask) from the log-ratios r; the rollout
log-probs are built as log pi_old - log rho, so the correction sees exactly the chosen rho.
Expected numbers are written out with Python's math module.
"""

import math

import pytest
import torch

from megatron_gspo.algorithms import RolloutCorrection, compute_policy_loss

ln = math.log


def rollout_from(old, mask, log_rhos):
    """log pi_rollout = log pi_old - log rho at response tokens (NaN elsewhere, to prove it is ignored)."""
    rollout = torch.full_like(old, float("nan"))
    for i, row in enumerate(log_rhos):
        rollout[i, : len(row)] = old[i, : len(row)] - torch.tensor(row, dtype=old.dtype)
    return rollout


def corrected_loss(loss_type, correction, log_probs, old, rollout, mask, adv, **options):
    weights, metrics = correction.weights(old, rollout, mask)
    loss, loss_metrics = compute_policy_loss(
        loss_type, log_probs, old, adv, mask, token_weights=weights, **options
    )
    return loss, weights, {**loss_metrics, **metrics}


def test_token_tis_with_grpo_truncates_per_token_and_keeps_the_clip(token_batch):
    # Row 0, A=+1, r = 1: rho = 3, 1.5, 0.5 -> w = 2 (truncated), 1.5, 0.5; loss_t = -w.
    # Row 1, A=-2: token 0 r = 1.1 (inside the clip), rho 1.2 -> 1.2 * 2 * 1.1;
    #              token 1 r = 0.5 (clipped low: 2 * 0.8, no gradient), rho 4 -> w = 2.
    log_probs, old, mask = token_batch([[0.0, 0.0, 0.0], [ln(1.1), ln(0.5)]])
    rollout = rollout_from(old, mask, [[ln(3), ln(1.5), ln(0.5)], [ln(1.2), ln(4)]])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    tis = RolloutCorrection.build("tis", "token", cap=2.0)
    loss, weights, metrics = corrected_loss("grpo", tis, log_probs, old, rollout, mask, adv)

    row0 = (-2.0 - 1.5 - 0.5) / 3
    row1 = (1.2 * 2 * 1.1 + 2.0 * 2 * 0.8) / 2
    assert loss.item() == pytest.approx((row0 + row1) / 2, abs=1e-6)
    loss.backward()
    expected = torch.tensor(
        [[-2.0 / 6, -1.5 / 6, -0.5 / 6], [1.2 * 2 * 1.1 / 4, 0.0, 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(log_probs.grad, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.5, 0.5], [1.2, 2.0, 0.0]]), rtol=0, atol=1e-6)
    assert metrics["rollout_corr/truncfrac_tokens"].item() == pytest.approx(2 / 5)
    assert metrics["rollout_corr/truncfrac_seq"].item() == 1.0
    assert metrics["rollout_corr/weight_mean"].item() == pytest.approx(7.2 / 5, abs=1e-6)
    assert metrics["rollout_corr/weight_max"].item() == pytest.approx(2.0)
    assert metrics["actor/clipfrac_tokens_low"].item() == pytest.approx(1 / 5)  # the clip is untouched


def test_sequence_tis_with_gspo_uses_the_geometric_mean(token_batch):
    # Row 0, A=+1: rho tokens 4, 1 -> geometric mean 2 (not the product 4, not the mean 2.5),
    #   cap 1.5 -> w = 1.5; s = e^0.0001 inside the trust region: loss -1.5 s, gradient -1.5 s / 2
    #   per token, / 2 responses.
    # Row 1, A=-0.5: rho 1.2 on every token -> w = 1.2; s = e^-0.001 below 1 - 3e-4: clipped,
    #   loss 1.2 * 0.5 * (1 - 3e-4), no gradient.
    log_probs, old, mask = token_batch([[0.0002, 0.0], [-0.002, 0.0, -0.001]])
    rollout = rollout_from(old, mask, [[ln(4), 0.0], [ln(1.2)] * 3])
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    tis = RolloutCorrection.build("tis", "sequence", cap=1.5)
    loss, weights, metrics = corrected_loss("gspo", tis, log_probs, old, rollout, mask, adv)

    s0 = math.exp(0.0001)
    assert loss.item() == pytest.approx((-1.5 * s0 + 1.2 * 0.5 * (1 - 3e-4)) / 2, abs=1e-6)
    loss.backward()
    expected = torch.zeros(2, 3, dtype=torch.float64)
    expected[0, :2] = -1.5 * s0 / 2 / 2
    torch.testing.assert_close(log_probs.grad, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.5, 0.0], [1.2, 1.2, 1.2]]), rtol=0, atol=1e-6)
    assert metrics["rollout_corr/truncfrac_seq"].item() == pytest.approx(1 / 2)
    assert metrics["rollout_corr/truncfrac_tokens"].item() == pytest.approx(2 / 5)
    assert metrics["rollout_corr/weight_mean"].item() == pytest.approx(6.6 / 5, abs=1e-6)

    # Above the cap's reach the weight is the geometric mean itself: 2.
    weights, _ = RolloutCorrection.build("tis", "sequence", cap=3.0).weights(old, rollout, mask)
    assert weights[0, 0].item() == pytest.approx(2.0, abs=1e-6)


def test_sequence_tis_with_grpo_weights_every_token_of_the_response(token_batch):
    # GRPO, A = -1, r = 1: token loss +1; rho 1.5 and 1/1.5 -> geometric mean 1, w = 1 on both
    # tokens (token level would give 1.5 and 0.667).
    log_probs, old, mask = token_batch([[0.0, 0.0]])
    rollout = rollout_from(old, mask, [[ln(1.5), -ln(1.5)]])
    adv = torch.tensor([-1.0], dtype=torch.float64)
    seq, _, _ = corrected_loss(
        "grpo", RolloutCorrection.build("tis", "sequence"), log_probs, old, rollout, mask, adv
    )
    token, _, _ = corrected_loss(
        "grpo", RolloutCorrection.build("tis", "token"), log_probs, old, rollout, mask, adv
    )
    assert seq.item() == pytest.approx(1.0, abs=1e-6)
    assert token.item() == pytest.approx((1.5 + 1 / 1.5) / 2, abs=1e-6)


def test_token_reject_with_grpo_drops_tokens_outside_the_band(token_batch):
    # Band [0.5, 2]. Row 0, A=+1, r=1: rho 3 (dropped), 1.5 (kept, weight 1), 0.4 (dropped):
    #   (0 - 1 + 0) / 3 -- dropped tokens stay in the 1/|y| normaliser.
    # Row 1, A=-1, r=1: rho 0.6, 1.9 kept: loss +1 per token.
    log_probs, old, mask = token_batch([[0.0, 0.0, 0.0], [0.0, 0.0]])
    rollout = rollout_from(old, mask, [[ln(3), ln(1.5), ln(0.4)], [ln(0.6), ln(1.9)]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    rej = RolloutCorrection.build("reject", "token")
    assert (rej.low, rej.high) == (0.5, 2.0)
    loss, weights, metrics = corrected_loss("grpo", rej, log_probs, old, rollout, mask, adv)
    assert loss.item() == pytest.approx((-1 / 3 + 1.0) / 2, abs=1e-6)
    loss.backward()
    expected = torch.tensor([[0.0, -1 / 6, 0.0], [0.25, 0.25, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(log_probs.grad, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]))
    assert metrics["rollout_corr/maskfrac_tokens"].item() == pytest.approx(2 / 5)
    assert metrics["rollout_corr/maskfrac_seq"].item() == pytest.approx(1 / 2)
    assert metrics["rollout_corr/weight_mean"].item() == pytest.approx(3 / 5)
    assert "rollout_corr/truncfrac_tokens" not in metrics


def test_sequence_reject_with_gspo_drops_whole_responses(token_batch):
    # Band [0.5, 2]. Row 0, A=+1: rho 4, 4 -> geometric mean 4: the response is dropped (no loss,
    # no gradient). Row 1, A=-1: rho 3 and 1/3, each outside the band, but geometric mean 1:
    # kept whole; s = 1, loss +1, gradient 1/2 per token, / 2 responses.
    log_probs, old, mask = token_batch([[0.0001, 0.0001], [0.0, 0.0]])
    rollout = rollout_from(old, mask, [[ln(4), ln(4)], [ln(3), -ln(3)]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    rej = RolloutCorrection.build("reject", "sequence")
    loss, weights, metrics = corrected_loss("gspo", rej, log_probs, old, rollout, mask, adv)
    assert loss.item() == pytest.approx(0.5, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(
        log_probs.grad, torch.tensor([[0.0, 0.0], [0.25, 0.25]], dtype=torch.float64), rtol=0, atol=1e-6
    )
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert metrics["rollout_corr/maskfrac_seq"].item() == pytest.approx(1 / 2)
    assert metrics["rollout_corr/maskfrac_tokens"].item() == pytest.approx(2 / 4)


def test_reject_band_is_inclusive():
    old = torch.tensor([[ln(0.5), ln(2.0), ln(0.49), ln(2.01)]])
    rollout = torch.zeros(1, 4)
    weights, _ = RolloutCorrection.build("reject", "token").weights(
        old, rollout, torch.ones(1, 4, dtype=torch.bool)
    )
    assert weights.tolist() == [[1.0, 1.0, 0.0, 0.0]]


def test_icepop_keeps_the_ratio_inside_the_band_and_drops_outside(token_batch):
    # Default band [0.5, 5], A=+1, r=1: rho 6 (dropped), 3 (w 3), 0.4 (dropped), 0.8 (w 0.8).
    log_probs, old, mask = token_batch([[0.0, 0.0, 0.0, 0.0]])
    rollout = rollout_from(old, mask, [[ln(6), ln(3), ln(0.4), ln(0.8)]])
    adv = torch.tensor([1.0], dtype=torch.float64)
    icepop = RolloutCorrection.build("icepop")
    assert (icepop.low, icepop.high) == (0.5, 5.0)
    loss, weights, metrics = corrected_loss("grpo", icepop, log_probs, old, rollout, mask, adv)
    assert loss.item() == pytest.approx(-(3 + 0.8) / 4, abs=1e-6)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 3.0, 0.0, 0.8]]), rtol=0, atol=1e-6)
    assert metrics["rollout_corr/maskfrac_tokens"].item() == pytest.approx(2 / 4)
    assert metrics["rollout_corr/maskfrac_seq"].item() == 1.0
    assert metrics["rollout_corr/weight_max"].item() == pytest.approx(3.0, abs=1e-6)
    # Configurable band: high 10 keeps rho 6 with its weight.
    weights, _ = RolloutCorrection.build("icepop", high=10.0).weights(old, rollout, mask)
    torch.testing.assert_close(weights, torch.tensor([[6.0, 3.0, 0.0, 0.8]]), rtol=0, atol=1e-5)


def test_none_is_all_ones_and_leaves_the_loss_unchanged(token_batch):
    log_probs, old, mask = token_batch([[0.1, -0.2], [0.05]])
    rollout = rollout_from(old, mask, [[ln(3), ln(0.1)], [ln(7)]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    off = RolloutCorrection.build()
    weights, metrics = off.weights(old, rollout, mask)
    assert not off.enabled and metrics == {}
    plain, _ = compute_policy_loss("grpo", log_probs, old, adv, mask)
    weighted, _ = compute_policy_loss("grpo", log_probs, old, adv, mask, token_weights=weights)
    assert weighted.item() == plain.item()


@pytest.mark.parametrize(
    "loss_type, method, level, refused",
    [
        ("gspo", "tis", "token", True),
        ("gspo", "reject", "token", True),
        ("gspo", "icepop", "token", True),
        ("gspo_token", "tis", "token", True),
        ("gspo", "tis", "sequence", False),
        ("gspo_token", "reject", "sequence", False),
        ("grpo", "tis", "token", False),
        ("grpo", "reject", "sequence", False),
        ("grpo", "icepop", "token", False),
        ("sapo", "tis", "token", False),
    ],
)
def test_token_level_refused_for_sequence_ratio_losses(loss_type, method, level, refused):
    from megatron_gspo.algorithms import POLICY_LOSSES

    correction = RolloutCorrection.build(method, level)
    spec = POLICY_LOSSES.get(loss_type)
    if refused:
        with pytest.raises(ValueError, match="rollout_correction.level=token .* use level=sequence"):
            correction.check_loss(loss_type, spec.sequence_ratio)
    else:
        correction.check_loss(loss_type, spec.sequence_ratio)


@pytest.mark.parametrize(
    "method, kwargs, message",
    [
        ("tis", {"cap": 0.0}, "cap must be >= 1"),
        ("tis", {"cap": -1.0}, "cap must be >= 1"),
        ("tis", {"cap": 0.5}, "cap must be >= 1"),
        ("tis", {"cap": math.inf}, "cap must be a finite number"),
        ("tis", {"cap": math.nan}, "cap must be a finite number"),
        ("tis", {"cap": True}, "cap must be a finite number"),
        ("tis", {"low": 0.5}, "low does not apply to method 'tis'"),
        ("reject", {"cap": 2.0}, "cap does not apply to method 'reject'"),
        ("mis", {"low": 0.5}, "low does not apply to method 'mis'"),
        ("mis", {"cap": 0.9}, "cap must be >= 1"),
        ("reject", {"low": 0.8, "high": 0.8}, "low < high"),
        ("reject", {"low": 1.0, "high": 1.0}, "low < high"),
        ("reject", {"low": 1.5, "high": 3.0}, "0 <= low <= 1 <= high"),
        ("reject", {"low": 0.2, "high": 0.9}, "0 <= low <= 1 <= high"),
        ("reject", {"low": -0.1}, "0 <= low <= 1 <= high"),
        ("icepop", {"high": math.inf}, "high must be a finite number"),
        ("icepop", {"low": math.nan}, "low must be a finite number"),
        ("icepop", {"level": "sequence"}, "IcePop masks tokens"),
        ("none", {"cap": 2.0}, "cap does not apply to method 'none'"),
        ("tis", {"level": "response"}, "level='response'; valid: token, sequence"),
        ("is", {}, "method='is'; valid: none, tis, mis, reject, icepop"),
    ],
)
def test_bad_options_are_refused_naming_the_field(method, kwargs, message):
    with pytest.raises(ValueError) as err:
        RolloutCorrection.build(method, **kwargs)
    assert message in str(err.value)
    assert "rollout_correction." in str(err.value)


def test_weights_stay_on_the_inputs_device_and_dtype_is_float32():
    old = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    weights, metrics = RolloutCorrection.build("tis", "sequence").weights(old, old - 5.0, mask)
    assert weights.dtype == torch.float32 and weights.device == old.device
    assert weights.tolist() == [[2.0, 2.0, 0.0], [2.0, 0.0, 0.0]]  # rho = e^5 truncated to 2
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_mis_as_published_keeps_rho_below_the_cap_and_drops_above():
    # "When Speed Kills Stability": w = rho if rho <= C else 0 (C = 2 by default); rho = 2 is kept.
    old = torch.tensor([[ln(0.3), ln(1.5), ln(2.0), ln(2.5), ln(40.0)]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    weights, metrics = RolloutCorrection.build("mis", "token").weights(old, torch.zeros(1, 5), mask)
    assert weights[0].tolist() == pytest.approx([0.3, 1.5, 2.0, 0.0, 0.0], rel=1e-6)
    assert metrics["rollout_corr/maskfrac_tokens"].item() == pytest.approx(2 / 5)
    assert RolloutCorrection.build("mis", "token", cap=3.0).cap == 3.0


def test_sequence_product_multiplies_the_token_ratios_in_log_space():
    # Row 0: rho 1.2 x 1.5 = 1.8 (geometric mean 1.342); row 1: 1.5 x 1.5 = 2.25 > 2: MIS drops it,
    # TIS caps it at 2. Row 2: 5000 tokens of rho 1.2: the product e^(5000 ln 1.2) overflows any
    # float, its log does not: dropped (mis) / capped (tis) without an inf or a NaN.
    log_rho = torch.zeros(3, 5000)
    mask = torch.zeros(3, 5000, dtype=torch.bool)
    log_rho[0, :2] = torch.tensor([ln(1.2), ln(1.5)])
    log_rho[1, :2] = ln(1.5)
    log_rho[2] = ln(1.2)
    mask[:2, :2] = True
    mask[2] = True
    old = log_rho.clone()
    rollout = torch.zeros(3, 5000)
    mis, _ = RolloutCorrection.build("mis", "sequence_product").weights(old, rollout, mask)
    tis, _ = RolloutCorrection.build("tis", "sequence_product").weights(old, rollout, mask)
    geo, _ = RolloutCorrection.build("tis", "sequence").weights(old, rollout, mask)
    assert mis[0, :2].tolist() == pytest.approx([1.8, 1.8], rel=1e-6)
    assert mis[1].abs().sum().item() == 0.0 and mis[2].abs().sum().item() == 0.0
    assert tis[1, :2].tolist() == pytest.approx([2.0, 2.0]) and tis[2].max().item() == pytest.approx(2.0)
    assert geo[0, 0].item() == pytest.approx(math.sqrt(1.8), rel=1e-6)
    assert torch.isfinite(mis).all() and torch.isfinite(tis).all()
    RolloutCorrection.build("mis", "sequence_product").check_loss("gspo", True)  # a sequence level: allowed
