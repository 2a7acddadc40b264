"""Registry behaviour and every bad-input case of compute_policy_loss."""

import math

import pytest
import torch

from megatron_gspo.algorithms import (
    POLICY_LOSSES,
    PolicyLossInputError,
    PolicyLossRegistry,
    PolicyLossTerms,
    compute_policy_loss,
    register_policy_loss,
)

NAN, INF = float("nan"), float("inf")


def _inputs(rows=2, width=3):
    log_probs = torch.full((rows, width), -1.0, requires_grad=True)
    old = torch.full((rows, width), -1.1)
    adv = torch.tensor([1.0, -1.0])[:rows]
    mask = torch.ones(rows, width, dtype=torch.bool)
    return log_probs, old, adv, mask


def test_builtin_losses_are_registered_with_their_defaults():
    assert {"gspo", "gspo_token", "grpo", "sapo"} <= set(POLICY_LOSSES.names())
    assert dict(POLICY_LOSSES.get("gspo").options) == {
        "clip_low": 3e-4,
        "clip_high": 4e-4,
        "clip_ratio_c": None,
        "log_ratio_clamp": 20.0,
    }
    assert dict(POLICY_LOSSES.get("grpo").options) == {
        "clip_low": 0.2,
        "clip_high": 0.27,
        "clip_ratio_c": None,
        "log_ratio_clamp": 20.0,
    }
    assert dict(POLICY_LOSSES.get("sapo").options) == {
        "tau_pos": 1.0,
        "tau_neg": 1.05,
        "log_ratio_clamp": 20.0,
    }
    for name in ("gspo", "gspo_token", "grpo", "sapo"):
        assert POLICY_LOSSES.get(name).default_agg_mode == "seq-mean-token-mean"


def test_a_new_loss_is_one_decorated_function():
    name = "reinforce_for_registry_test"

    @register_policy_loss(name, default_agg_mode="token-mean")
    def reinforce(inputs, *, scale=1.0):
        loss = -scale * inputs.advantages * inputs.log_probs
        none = torch.zeros_like(inputs.response_mask)
        return PolicyLossTerms(loss, torch.exp(inputs.token_log_ratio()).detach(), none, none)

    try:
        log_probs, old, adv, mask = _inputs()
        loss, metrics = compute_policy_loss(name, log_probs, old, adv, mask, scale=2.0)
        # token-mean of -2 A logp with logp = -1: A = (+1 x3, -1 x3) -> (3 * 2 - 3 * 2) / 6 = 0.
        assert loss.item() == pytest.approx(0.0)
        loss.backward()
        assert log_probs.grad[0].tolist() == pytest.approx([-2 / 6] * 3)
        assert metrics["actor/ratio_mean"].item() == pytest.approx(math.exp(0.1), rel=1e-6)
        with pytest.raises(
            ValueError, match=r"option\(s\) \['clip_low'\] do not apply .* its options: scale"
        ):
            compute_policy_loss(name, log_probs, old, adv, mask, clip_low=0.1)
    finally:
        POLICY_LOSSES.unregister(name)
    assert name not in POLICY_LOSSES


def test_registry_rejects_duplicates_and_lists_names_on_a_miss():
    registry = PolicyLossRegistry()

    @registry.register("a")
    def first(inputs):
        raise AssertionError

    with pytest.raises(ValueError, match="'a' is already registered"):
        registry.register("a")(first)
    with pytest.raises(ValueError, match="unknown policy loss 'b'; supported: a"):
        registry.get("b")
    with pytest.raises(ValueError, match="supported: grpo, gspo, gspo_token, sapo"):
        compute_policy_loss("ppo", *_inputs())
    with pytest.raises(ValueError, match="'gspo' is already registered"):
        register_policy_loss("gspo")(first)


def test_registry_enforces_the_function_contract():
    registry = PolicyLossRegistry()
    with pytest.raises(TypeError, match="option 'clip' must be keyword-only with a default"):

        @registry.register("x")
        def positional_option(inputs, clip=0.2):
            raise AssertionError

    with pytest.raises(TypeError, match="option 'clip' must be keyword-only with a default"):

        @registry.register("y")
        def no_default(inputs, *, clip):
            raise AssertionError

    with pytest.raises(TypeError, match="first parameter must be the positional `inputs`"):

        @registry.register("z")
        def no_inputs(*, clip=0.1):
            raise AssertionError

    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        registry.register("w", default_agg_mode="mean")
    with pytest.raises(ValueError, match="non-empty string"):
        registry.register("")


@pytest.mark.parametrize(
    "loss_type,options,match",
    [
        ("grpo", {"tau_pos": 1.0}, r"\['tau_pos'\] do not apply to policy loss 'grpo'"),
        ("gspo", {"tau_pos": 3.0}, r"\['tau_pos'\] do not apply to policy loss 'gspo'"),
        ("gspo", {"clip_ratio_c": 0.5}, "clip_ratio_c must be finite and > 1.0"),
        ("sapo", {"clip_low": 0.2}, r"\['clip_low'\] do not apply to policy loss 'sapo'"),
        ("grpo", {"allow_token_sum_for_gspo": True}, "only applies to sequence-ratio losses"),
        ("sapo", {"loss_agg_mode": "seq-mean"}, "unknown loss_agg_mode 'seq-mean'"),
        ("grpo", {"clip_low": 1.0}, r"clip_low must be in \[0, 1.0\)"),
        ("grpo", {"clip_low": -0.1}, "clip_low must be in"),
        ("gspo_token", {"clip_high": -1e-4}, "clip_high must be >= 0"),
        ("gspo", {"clip_low": NAN}, "clip_low must be a real number"),
        ("gspo", {"clip_high": True}, "clip_high must be a real number"),
        ("grpo", {"clip_ratio_c": 1.0}, "clip_ratio_c must be finite and > 1.0"),
        ("grpo", {"log_ratio_clamp": 0.0}, "log_ratio_clamp must be finite and > 0"),
        ("sapo", {"tau_pos": 0.0}, "tau_pos must be finite and > 0"),
        ("sapo", {"tau_neg": INF}, "tau_neg must be finite and > 0"),
        ("sapo", {"tau_neg": "1.05"}, "tau_neg must be a real number"),
    ],
)
def test_bad_options_are_errors(loss_type, options, match):
    log_probs, old, adv, mask = _inputs()
    with pytest.raises(ValueError, match=match):
        compute_policy_loss(loss_type, log_probs, old, adv, mask, **options)


@pytest.mark.parametrize("loss_type", ["gspo", "gspo_token"])
@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_gspo_refuses_token_sum_modes_unless_forced(loss_type, mode):
    log_probs, old, adv, mask = _inputs()
    with pytest.raises(ValueError, match="allow_token_sum_for_gspo=True"):
        compute_policy_loss(loss_type, log_probs, old, adv, mask, loss_agg_mode=mode)
    loss, _ = compute_policy_loss(
        loss_type, log_probs, old, adv, mask, loss_agg_mode=mode, allow_token_sum_for_gspo=True
    )
    assert torch.isfinite(loss)


def test_gspo_needs_one_advantage_per_response():
    log_probs, old, _, mask = _inputs()
    with pytest.raises(PolicyLossInputError, match=r"takes one advantage per response.*use 'gspo_token'"):
        compute_policy_loss("gspo", log_probs, old, torch.zeros(2, 3), mask)


def _with(tensor, index, value):
    tensor = tensor.detach().clone()
    tensor[index] = value
    return tensor


@pytest.mark.parametrize(
    "change,match",
    [
        (
            lambda lp, old, adv, m: (lp[:, :2], old, adv, m),
            r"log_probs has shape \(2, 2\), expected \(2, 3\)",
        ),
        (lambda lp, old, adv, m: (lp, old[:1], adv, m), r"old_log_probs has shape \(1, 3\)"),
        (
            lambda lp, old, adv, m: (lp, old, torch.zeros(3), m),
            r"advantages has shape \(3,\), expected \[B\]",
        ),
        (lambda lp, old, adv, m: (lp, old, adv, m[0]), r"response_mask must be 2-D \[B, T\]"),
        (
            lambda lp, old, adv, m: (lp, old, adv, m.tolist()),
            "response_mask must be a torch.Tensor, got list",
        ),
        (lambda lp, old, adv, m: (lp, old.long(), adv, m), "old_log_probs must be a floating-point tensor"),
        (lambda lp, old, adv, m: (lp, old, adv.long(), m), "advantages must be a floating-point"),
        (lambda lp, old, adv, m: (_with(lp, (1, 2), NAN), old, adv, m), r"log_probs is NaN .* \(1, 2\)"),
        (
            lambda lp, old, adv, m: (_with(lp, (0, 0), -INF), old, adv, m),
            r"log_probs is NaN or inf .* \(0, 0\)",
        ),
        (
            lambda lp, old, adv, m: (lp, _with(old, (0, 1), INF), adv, m),
            r"old_log_probs is NaN or inf .* \(0, 1\)",
        ),
        (
            lambda lp, old, adv, m: (lp, old, _with(adv, 1, NAN), m),
            r"advantages are NaN or inf at position \(1,\)",
        ),
        (
            lambda lp, old, adv, m: (lp, old, torch.tensor([[0.0, INF, 0.0], [0.0] * 3]), m),
            r"advantages are NaN or inf at position \(0, 1\)",
        ),
        (
            lambda lp, old, adv, m: (lp, old, adv, torch.zeros_like(m)),
            "selects no tokens: every response is empty",
        ),
        (
            lambda lp, old, adv, m: (lp, old, adv, _with(m, (1, slice(None)), False)),
            r"row\(s\) \[1\] have zero tokens",
        ),
        (lambda lp, old, adv, m: (lp, old, adv, m.float() * 2), "only 0/1"),
        (lambda lp, old, adv, m: (lp[:0], old[:0], adv[:0], m[:0]), "response_mask is empty"),
    ],
)
@pytest.mark.parametrize("loss_type", ["gspo_token", "grpo"])
def test_bad_tensors_raise_policy_loss_input_error(loss_type, change, match):
    args = change(*_inputs())
    with pytest.raises(PolicyLossInputError, match=match):
        compute_policy_loss(loss_type, *args)


@pytest.mark.parametrize(
    "normalizer,match",
    [
        (0.0, "finite and > 0, got 0.0"),
        (-3, "finite and > 0"),
        (INF, "finite and > 0"),
        (torch.tensor(NAN), "finite and > 0, got nan"),
        (torch.tensor(0.0, dtype=torch.float64), "finite and > 0"),
        (torch.ones(2), r"normalizer must be a scalar, got a tensor of shape \(2,\)"),
        ("6", "normalizer must be a number or a tensor, got str"),
    ],
)
def test_bad_normalizer(normalizer, match):
    with pytest.raises(PolicyLossInputError, match=match):
        compute_policy_loss("grpo", *_inputs(), normalizer=normalizer)


def test_policy_loss_input_error_is_a_value_error():
    assert issubclass(PolicyLossInputError, ValueError)


@pytest.mark.parametrize("loss_type", ["gspo", "gspo_token", "grpo", "sapo"])
@pytest.mark.parametrize("pad", [NAN, INF, -INF, 1e30])
def test_padding_values_are_ignored(loss_type, pad):
    gen = torch.Generator().manual_seed(3)
    log_probs = -torch.rand(3, 5, generator=gen, dtype=torch.float64)
    old = log_probs - 0.1 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    if loss_type in ("grpo", "sapo", "gspo_token"):
        adv = adv.unsqueeze(-1).expand(3, 5).masked_fill(~mask, pad)

    clean = log_probs.clone().requires_grad_(True)
    loss_clean, metrics_clean = compute_policy_loss(loss_type, clean, old, adv.nan_to_num(0.0), mask)
    loss_clean.backward()

    dirty = log_probs.masked_fill(~mask, pad).requires_grad_(True)
    loss_dirty, metrics_dirty = compute_policy_loss(loss_type, dirty, old.masked_fill(~mask, pad), adv, mask)
    loss_dirty.backward()

    assert loss_dirty.item() == loss_clean.item()
    assert torch.equal(dirty.grad, clean.grad)
    assert torch.isfinite(dirty.grad).all()
    for key, value in metrics_clean.items():
        assert torch.isfinite(metrics_dirty[key]), key
        assert metrics_dirty[key].item() == pytest.approx(value.item(), rel=1e-6), key


def test_metrics_are_detached_scalars():
    log_probs, old, adv, mask = _inputs()
    for loss_type in ("gspo", "gspo_token", "grpo", "sapo"):
        loss, metrics = compute_policy_loss(loss_type, log_probs, old, adv, mask)
        assert loss.requires_grad and loss.dim() == 0
        for key, value in metrics.items():
            assert key.startswith("actor/")
            assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad, key
