"""GSPO-token with A_it = A_i equals GSPO: loss value, clip decisions and metrics, gradient."""

import pytest
import torch

from megatron_gspo.algorithms import compute_policy_loss

CLIP_KEYS = [
    "actor/clipfrac_tokens",
    "actor/clipfrac_tokens_low",
    "actor/clipfrac_tokens_high",
    "actor/clipfrac_seq",
    "actor/clipfrac_seq_low",
    "actor/clipfrac_seq_high",
]


def _batch(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, width = 12, 9
    log_probs = -torch.rand(rows, width, generator=gen, dtype=torch.float64) * 3
    # Per-token log-ratios of order 1e-3 put some responses inside GSPO's tiny clip band and
    # some outside on both sides.
    old = log_probs - 1e-3 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = torch.arange(width) < lengths.unsqueeze(-1)
    adv = torch.randn(rows, generator=gen, dtype=torch.float64)
    return log_probs, old, mask, adv


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "mode,forced",
    [("seq-mean-token-mean", False), ("token-mean", False), ("seq-mean-token-sum", True)],
)
def test_gspo_token_matches_gspo_for_constant_advantages(seed, mode, forced):
    log_probs, old, mask, adv = _batch(seed)
    extra = {"allow_token_sum_for_gspo": True} if forced else {}

    lp_seq = log_probs.clone().requires_grad_(True)
    loss_seq, metrics_seq = compute_policy_loss("gspo", lp_seq, old, adv, mask, loss_agg_mode=mode, **extra)
    loss_seq.backward()

    lp_tok = log_probs.clone().requires_grad_(True)
    token_adv = adv.unsqueeze(-1).expand_as(log_probs).clone()
    loss_tok, metrics_tok = compute_policy_loss(
        "gspo_token", lp_tok, old, token_adv, mask, loss_agg_mode=mode, **extra
    )
    loss_tok.backward()

    torch.testing.assert_close(loss_tok, loss_seq, rtol=0, atol=1e-6)
    torch.testing.assert_close(lp_tok.grad, lp_seq.grad, rtol=0, atol=1e-6)
    for key in CLIP_KEYS:
        assert metrics_tok[key].item() == metrics_seq[key].item(), key
    # The batch really exercises both clip sides and the unclipped branch.
    assert 0 < metrics_seq["actor/clipfrac_seq"].item() < 1
    assert metrics_seq["actor/clipfrac_seq_low"].item() > 0
    assert metrics_seq["actor/clipfrac_seq_high"].item() > 0
    assert lp_seq.grad.abs().sum() > 0


def test_gspo_token_clip_masks_equal_gspo_masks():
    from megatron_gspo.algorithms.losses import gspo_loss, gspo_token_loss
    from megatron_gspo.algorithms.policy_loss import build_policy_loss_inputs

    log_probs, old, mask, adv = _batch(5)
    seq_terms = gspo_loss(build_policy_loss_inputs(log_probs, old, adv, mask))
    tok_adv = adv.unsqueeze(-1).expand_as(log_probs)
    tok_terms = gspo_token_loss(build_policy_loss_inputs(log_probs, old, tok_adv, mask))
    assert torch.equal(seq_terms.clipped_low, tok_terms.clipped_low)
    assert torch.equal(seq_terms.clipped_high, tok_terms.clipped_high)
    torch.testing.assert_close(seq_terms.ratio, tok_terms.ratio, rtol=0, atol=1e-12)
