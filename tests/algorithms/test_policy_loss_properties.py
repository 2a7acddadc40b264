"""Property tests (hypothesis) of GSPO's length normalisation and GRPO's clip."""

import math

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_gspo.algorithms import compute_policy_loss


@settings(max_examples=60, deadline=None)
@given(
    log_ratio=st.floats(-0.5, 0.5),
    length=st.integers(1, 64),
    advantage=st.floats(-3, 3).filter(lambda a: abs(a) > 1e-3),
)
def test_gspo_ratio_is_invariant_to_length_for_constant_log_ratio(log_ratio, length, advantage):
    def run(n):
        log_probs = torch.full((1, n), -1.0, dtype=torch.float64, requires_grad=True)
        old = log_probs.detach() - log_ratio
        mask = torch.ones(1, n, dtype=torch.bool)
        loss, metrics = compute_policy_loss(
            "gspo", log_probs, old, torch.tensor([advantage], dtype=torch.float64), mask
        )
        loss.backward()
        return loss.item(), metrics["actor/ratio_mean"].item(), log_probs.grad.sum().item()

    loss_n, ratio_n, grad_sum_n = run(length)
    loss_1, ratio_1, grad_sum_1 = run(1)
    assert math.isclose(ratio_n, math.exp(log_ratio), rel_tol=1e-6)
    assert math.isclose(ratio_n, ratio_1, rel_tol=1e-6)
    assert math.isclose(loss_n, loss_1, rel_tol=1e-9, abs_tol=1e-12)
    # Every token carries 1/|y| of the response's gradient: the total does not depend on length.
    assert math.isclose(grad_sum_n, grad_sum_1, rel_tol=1e-9, abs_tol=1e-12)


@settings(max_examples=150, deadline=None)
@given(
    log_ratios=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=12),
    advantages=st.lists(st.floats(-2.0, 2.0).filter(lambda a: abs(a) > 1e-3), min_size=12, max_size=12),
    clip_low=st.floats(0.01, 0.5),
    clip_high=st.floats(0.01, 0.5),
)
def test_grpo_clip_blocks_gradient_outside_the_trust_region(log_ratios, advantages, clip_low, clip_high):
    n = len(log_ratios)
    ratios = [math.exp(x) for x in log_ratios]
    # Stay away from the exact boundaries, where the branch choice is a tie.
    assume(all(abs(r - (1 - clip_low)) > 1e-6 and abs(r - (1 + clip_high)) > 1e-6 for r in ratios))
    log_probs = torch.full((1, n), -0.7, dtype=torch.float64, requires_grad=True)
    old = log_probs.detach() - torch.tensor([log_ratios], dtype=torch.float64)
    adv = torch.tensor([advantages[:n]], dtype=torch.float64)
    mask = torch.ones(1, n, dtype=torch.bool)
    loss, _ = compute_policy_loss(
        "grpo", log_probs, old, adv, mask, loss_agg_mode="token-mean", clip_low=clip_low, clip_high=clip_high
    )
    loss.backward()
    for t in range(n):
        a, r, g = advantages[t], ratios[t], log_probs.grad[0, t].item()
        if (a > 0 and r > 1 + clip_high) or (a < 0 and r < 1 - clip_low):
            assert g == 0.0
        else:
            # Otherwise the unclipped surrogate's gradient -A r / n flows.
            assert math.isclose(g, -a * r / n, rel_tol=1e-9)
