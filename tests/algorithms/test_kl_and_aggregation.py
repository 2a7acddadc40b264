import math

import pytest
import torch

from megatron_gspo.algorithms import (
    LOSS_AGG_MODES,
    aggregate_loss,
    compute_kl_loss,
    compute_loss_normalizer,
    kl_penalty,
)

NAN = float("nan")


def test_kl_estimators_hand_values_and_gradients():
    d = [0.5, -0.2, 0.0]
    log_probs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = log_probs.detach() - torch.tensor([d], dtype=torch.float64)
    expected = {
        "k1": ([x for x in d], [1.0, 1.0, 1.0]),
        "k2": ([0.5 * x * x for x in d], [x for x in d]),
        "k3": ([math.exp(-x) - 1 + x for x in d], [1 - math.exp(-x) for x in d]),
    }
    for name, (values, grads) in expected.items():
        log_probs.grad = None
        out = kl_penalty(log_probs, ref, name)
        assert out[0].tolist() == pytest.approx(values, abs=1e-12)
        out.sum().backward()
        assert log_probs.grad[0].tolist() == pytest.approx(grads, abs=1e-12)


def test_k3_clamps_like_verl_and_roll_and_low_var_kl_is_k3():
    # verl low_var_kl / ROLL k3: d clamped to [-20, 20], the estimate to at most 10 (no gradient past it).
    log_probs = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[15.0, 2.0, -30.0]], dtype=torch.float64)
    out = kl_penalty(log_probs, ref, "low_var_kl")
    assert out[0].tolist() == pytest.approx([10.0, math.exp(2.0) - 1 - 2.0, 10.0])  # d = -15, -2, 30
    out.sum().backward()
    assert log_probs.grad[0].tolist() == pytest.approx([0.0, 1 - math.exp(2.0), 0.0])
    assert torch.equal(kl_penalty(log_probs, ref, "k3"), out)


def test_k3_is_finite_for_extreme_log_ratios():
    log_probs = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[200.0, -200.0]])
    assert torch.isfinite(kl_penalty(log_probs, ref, "k3")).all()


def test_compute_kl_loss_hand_value_ignores_nan_padding():
    log_probs = torch.tensor([[-1.0, -2.0, NAN], [-0.5, NAN, NAN]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.8, NAN], [-0.5, NAN, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, metrics = compute_kl_loss(log_probs, ref, mask, coef=0.01, loss_agg_mode="seq-mean-token-mean")

    def k3(d):
        return math.exp(-d) - 1 + d

    row0 = (k3(0.5) + k3(-0.2)) / 2
    expected = 0.01 * (row0 + k3(0.0)) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-14)
    assert metrics["actor/kl_ref"].item() == pytest.approx((k3(0.5) + k3(-0.2) + k3(0.0)) / 3, rel=1e-6)
    assert metrics["actor/kl_loss"].item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert torch.isfinite(log_probs.grad).all()
    assert log_probs.grad[0, 2].item() == 0.0 and log_probs.grad[1, 1].item() == 0.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"coef": -0.1, "loss_agg_mode": "token-mean"}, "coef must be a finite number >= 0"),
        ({"coef": float("inf"), "loss_agg_mode": "token-mean"}, "coef must be"),
        ({"coef": 0.1, "loss_agg_mode": "mean"}, "unknown loss_agg_mode 'mean'"),
        (
            {"coef": 0.1, "loss_agg_mode": "token-mean", "estimator": "k4"},
            "unknown KL estimator 'k4'; valid: k1",
        ),
    ],
)
def test_kl_loss_bad_options(kwargs, match):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match):
        compute_kl_loss(x, x, torch.ones(1, 2), **kwargs)


def test_kl_bad_tensors():
    from megatron_gspo.algorithms import PolicyLossInputError

    x = torch.zeros(2, 3)
    ref = x.clone()
    ref[1, 0] = NAN
    with pytest.raises(
        PolicyLossInputError, match=r"ref_log_probs is NaN or inf at masked-in position .* \(1, 0\)"
    ):
        compute_kl_loss(x, ref, torch.ones(2, 3), coef=0.1, loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(x, x, "k0")
    with pytest.raises(ValueError, match="differ in shape"):
        kl_penalty(x, torch.zeros(3, 2), "k1")


# Per-token losses of 2 responses (3 and 1 tokens) in a width-4 batch.
LOSSES = [[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN]]
MASK = [[1, 1, 1, 0], [1, 0, 0, 0]]


@pytest.mark.parametrize(
    "mode,expected,normalizer",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4, 4.0),
        ("seq-mean-token-sum", ((1 + 2 + 3) + 4) / 2, 2.0),
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4) / 2, 2.0),
        ("seq-mean-token-sum-norm", (1 + 2 + 3 + 4) / (2 * 4), 8.0),
    ],
)
def test_aggregation_modes_hand_values(mode, expected, normalizer):
    losses = torch.tensor(LOSSES, dtype=torch.float64)
    mask = torch.tensor(MASK, dtype=torch.bool)
    assert aggregate_loss(losses, mask, mode).item() == pytest.approx(expected)
    assert compute_loss_normalizer(mask, mode).item() == normalizer
    # An external (global) normaliser replaces the local one.
    assert aggregate_loss(losses, mask, mode, normalizer=2 * normalizer).item() == pytest.approx(expected / 2)


def test_sum_norm_uses_the_configured_max_length():
    mask = torch.tensor(MASK)
    assert compute_loss_normalizer(mask, "seq-mean-token-sum-norm", max_response_length=100).item() == 200.0


def test_normalizer_is_a_float64_scalar_for_all_reduce():
    for mode in LOSS_AGG_MODES:
        n = compute_loss_normalizer(torch.tensor(MASK), mode)
        assert n.dtype == torch.float64 and n.dim() == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"loss_agg_mode": "token-mean", "max_response_length": 8}, "only applies to loss_agg_mode"),
        ({"loss_agg_mode": "seq-mean-token-sum-norm", "max_response_length": 0}, "must be > 0"),
        ({"loss_agg_mode": "seq-mean-token-sum-norm", "max_response_length": 2.5}, "must be an int"),
        ({"loss_agg_mode": "sum"}, "unknown loss_agg_mode 'sum'; valid modes: token-mean"),
    ],
)
def test_normalizer_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_loss_normalizer(torch.tensor(MASK), **kwargs)


def test_normalizer_bad_masks():
    from megatron_gspo.algorithms import PolicyLossInputError

    with pytest.raises(PolicyLossInputError, match="selects no tokens"):
        compute_loss_normalizer(torch.zeros(2, 3), "token-mean")
    with pytest.raises(PolicyLossInputError, match=r"row\(s\) \[1\] have zero tokens"):
        compute_loss_normalizer(torch.tensor([[1, 0], [0, 0]]), "token-mean")
    with pytest.raises(PolicyLossInputError, match="2-D"):
        compute_loss_normalizer(torch.ones(3), "token-mean")
    with pytest.raises(PolicyLossInputError, match="0/1"):
        compute_loss_normalizer(torch.tensor([[1.0, 0.5]]), "token-mean")


def test_aggregate_loss_refuses_nan_at_tokens():
    from megatron_gspo.algorithms import PolicyLossInputError

    losses = torch.tensor([[1.0, NAN]])
    with pytest.raises(PolicyLossInputError, match=r"token_losses is NaN or inf .* \(0, 1\)"):
        aggregate_loss(losses, torch.ones(1, 2), "token-mean")
