"""One mini-batch == its micro-batches on 2 simulated data-parallel ranks (global normaliser):
strided rows in 4 micro-batches each, or a token budget with rows balanced by tokens."""

import pytest
import torch

from megatron_gspo.algorithms import (
    LOSS_AGG_MODES,
    TOKEN_SUM_AGG_MODES,
    compute_kl_loss,
    compute_loss_normalizer,
    compute_policy_loss,
)
from megatron_gspo.training.step.micro_batches import DataLayout, split_by_tokens

ROWS, WIDTH, DP, MICRO = 16, 11, 2, 4

CASES = []
for _loss in ["gspo", "gspo_token", "grpo", "sapo"]:
    for _mode in LOSS_AGG_MODES:
        CASES.append((_loss, _mode))


def _batch(loss_type):
    gen = torch.Generator().manual_seed(7)
    log_probs = -torch.rand(ROWS, WIDTH, generator=gen, dtype=torch.float64) * 3
    scale = 1e-3 if loss_type.startswith("gspo") else 0.3  # exercise each loss's clip range
    old = log_probs - scale * torch.randn(ROWS, WIDTH, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, WIDTH + 1, (ROWS,), generator=gen)
    mask = torch.arange(WIDTH) < lengths.unsqueeze(-1)
    # Padding holds garbage: it must not matter.
    log_probs = log_probs.masked_fill(~mask, float("nan"))
    adv = torch.randn(ROWS, generator=gen, dtype=torch.float64)
    if loss_type in ("gspo_token", "grpo", "sapo"):
        adv = adv.unsqueeze(-1) + 0.5 * torch.randn(ROWS, WIDTH, generator=gen, dtype=torch.float64)
    return log_probs, old, mask, adv


def _options(loss_type, mode):
    options = {"loss_agg_mode": mode}
    if loss_type.startswith("gspo") and mode in TOKEN_SUM_AGG_MODES:
        options["allow_token_sum_for_gspo"] = True
    if loss_type == "grpo":
        options["clip_ratio_c"] = 1.5
    return options


def _trim(tensor, mask):
    # Each micro-batch is padded only to its own longest response, as a packer would.
    width = int(mask.sum(-1).max())
    return tensor[:, :width] if tensor.dim() == 2 else tensor


def _full_and_split(loss_type, mode, ranks):
    """Loss and gradient of the whole batch, and of `ranks` (per rank, its micro-batches' rows)."""
    log_probs, old, mask, adv = _batch(loss_type)
    options = _options(loss_type, mode)

    full_lp = log_probs.clone().requires_grad_(True)
    full_loss, full_metrics = compute_policy_loss(loss_type, full_lp, old, adv, mask, **options)
    full_loss.backward()
    assert torch.isfinite(full_loss)
    assert full_metrics["actor/clipfrac_tokens"].item() > 0 or loss_type == "sapo"

    split_lp = log_probs.clone().requires_grad_(True)
    extra = {"max_response_length": WIDTH} if mode == "seq-mean-token-sum-norm" else {}
    # Each rank computes its share; the sum plays the role of all_reduce(SUM).
    normalizer = sum(compute_loss_normalizer(mask[torch.cat(micros)], mode, **extra) for micros in ranks)
    total = torch.zeros((), dtype=torch.float64)
    for micros in ranks:
        for micro in micros:
            m = _trim(mask[micro], mask[micro])
            loss, _ = compute_policy_loss(
                loss_type,
                _trim(split_lp[micro], m),
                _trim(old[micro], m),
                _trim(adv[micro], m),
                m,
                normalizer=normalizer,
                **options,
            )
            loss.backward()  # gradients of all micro-batches and ranks accumulate (summed)
            total = total + loss.detach()
    assert full_lp.grad.abs().sum() > 0
    return (full_loss.detach(), full_lp.grad), (total, split_lp.grad)


@pytest.mark.parametrize("loss_type,mode", CASES)
def test_policy_loss_is_split_invariant(loss_type, mode):
    ranks = [rows.chunk(MICRO) for rows in torch.arange(ROWS).chunk(DP)]
    (full, full_grad), (split, split_grad) = _full_and_split(loss_type, mode, ranks)
    torch.testing.assert_close(split, full, rtol=0, atol=1e-10)
    torch.testing.assert_close(split_grad, full_grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize("loss_type,mode", CASES)
def test_policy_loss_is_invariant_to_token_budget_micro_batches(loss_type, mode):
    # Uneven response lengths 1..11 cut by a budget of 20 tokens, rows balanced over the ranks
    # by tokens (not strided): micro-batches of different row counts and lengths on each rank.
    _, _, mask, _ = _batch(loss_type)
    lengths = mask.sum(-1).tolist()
    cut = split_by_tokens(lengths, DP, 20, DataLayout(packing="thd").cost)
    ranks = [[torch.tensor(micro) for micro in micros] for micros in cut]
    assert len({len(micro) for micros in ranks for micro in micros}) > 1
    (full, full_grad), (split, split_grad) = _full_and_split(loss_type, mode, ranks)
    torch.testing.assert_close(split, full, rtol=0, atol=1e-10)
    torch.testing.assert_close(split_grad, full_grad, rtol=0, atol=1e-10)


def test_local_normalizer_differs_from_global():
    # Without the global normaliser, per-micro-batch token means do NOT add up to the full loss.
    log_probs, old, mask, adv = _batch("grpo")
    full, _ = compute_policy_loss("grpo", log_probs, old, adv, mask, loss_agg_mode="token-mean")
    parts = [
        compute_policy_loss("grpo", log_probs[r], old[r], adv[r], mask[r], loss_agg_mode="token-mean")[0]
        for r in torch.arange(ROWS).chunk(MICRO)
    ]
    assert abs(sum(parts).item() / MICRO - full.item()) > 1e-4


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_loss_is_split_invariant(mode, estimator):
    log_probs, ref, mask, _ = _batch("grpo")
    full_lp = log_probs.clone().requires_grad_(True)
    full, _ = compute_kl_loss(full_lp, ref, mask, coef=0.1, loss_agg_mode=mode, estimator=estimator)
    full.backward()

    split_lp = log_probs.clone().requires_grad_(True)
    normalizer = compute_loss_normalizer(mask, mode)
    total = 0.0
    for rows in torch.arange(ROWS).chunk(DP * MICRO):
        loss, _ = compute_kl_loss(
            split_lp[rows],
            ref[rows],
            mask[rows],
            coef=0.1,
            loss_agg_mode=mode,
            normalizer=normalizer,
            estimator=estimator,
        )
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(full.item(), abs=1e-10)
    torch.testing.assert_close(split_lp.grad, full_lp.grad, rtol=0, atol=1e-10)
