import math
import statistics

import pytest
import torch

from megatron_gspo.algorithms import RunningMeanStd, compute_group_advantages

EPS = 1e-6


def test_group_normalisation_hand_values_and_zero_advantage_fraction():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.3, 0.3, 0.3, 0.3])
    adv, metrics = compute_group_advantages(rewards, 4)
    # Group 1: mean 0.25, sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5.
    expected_first = [0.75 / (0.5 + EPS)] + [-0.25 / (0.5 + EPS)] * 3
    assert adv[:4].tolist() == pytest.approx(expected_first, rel=1e-6)
    # Constant groups give exactly zero, not rounding noise / eps.
    assert adv[4:].tolist() == [0.0] * 8
    assert metrics["advantages/zero_adv_group_frac"].item() == pytest.approx(2 / 3)
    assert metrics["rewards/mean"].item() == pytest.approx(statistics.mean(rewards.tolist()), rel=1e-6)
    assert metrics["advantages/max"].item() == pytest.approx(1.5, rel=1e-5)
    assert adv.dtype == torch.float32


def test_std_convention_is_the_sample_std():
    # G = 2, rewards 0 and 1: sample std 1/sqrt(2), so A = +-0.5 * sqrt(2) (population std would give +-1).
    adv, _ = compute_group_advantages(torch.tensor([0.0, 1.0]), 2, eps=0.0)
    assert adv.tolist() == pytest.approx([-math.sqrt(0.5), math.sqrt(0.5)], rel=1e-6)


def test_batch_normalisation_matches_statistics_module():
    rewards = [0.2, 1.5, -0.7, 3.0, 0.0, 0.4]
    adv, metrics = compute_group_advantages(torch.tensor(rewards), 3, reward_norm="batch")
    mu, sd = statistics.mean(rewards), statistics.stdev(rewards)
    assert adv.tolist() == pytest.approx([(r - mu) / (sd + EPS) for r in rewards], rel=1e-5)
    assert metrics["advantages/zero_adv_group_frac"].item() == 0.0


def test_no_normalisation_applies_shift_and_scale():
    adv, _ = compute_group_advantages(
        torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, reward_norm="none", reward_shift=-0.5, reward_scale=2.0
    )
    assert adv.tolist() == pytest.approx([1.0, -1.0, 3.0, 3.0])


def test_reward_clip_applies_before_normalising():
    adv, metrics = compute_group_advantages(torch.tensor([5.0, -5.0, 0.0, 1.0]), 4, reward_clip=2.0)
    clipped = [2.0, -2.0, 0.0, 1.0]
    mu, sd = statistics.mean(clipped), statistics.stdev(clipped)
    assert adv.tolist() == pytest.approx([(r - mu) / (sd + EPS) for r in clipped], rel=1e-5)
    # Raw-reward statistics are reported before clipping.
    assert metrics["rewards/mean"].item() == pytest.approx(0.25)


def test_advantage_clip_and_its_fraction():
    adv, metrics = compute_group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, advantage_clip=1.0)
    assert adv.tolist() == pytest.approx([1.0] + [-0.25 / (0.5 + EPS)] * 3, rel=1e-6)
    assert metrics["advantages/clipfrac"].item() == pytest.approx(0.25)


def test_whitening_after_group_rescales_and_keeps_zero_groups_zero():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 1.0, 1.0])
    group_adv, _ = compute_group_advantages(rewards, 3)
    adv, metrics = compute_group_advantages(rewards, 3, whiten_advantages=True)
    values = group_adv.double().tolist()
    sd = statistics.stdev(values)  # mean is zero by construction
    assert adv.tolist() == pytest.approx([v / (sd + EPS) for v in values], rel=1e-5)
    const, m = compute_group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2, whiten_advantages=True)
    assert const[2:].tolist() == [0.0, 0.0]
    assert m["advantages/zero_adv_group_frac"].item() == 0.5
    assert statistics.stdev(adv.double().tolist()) == pytest.approx(1.0, rel=1e-4)


def test_whitening_after_batch_norm_centres_and_scales():
    rewards = [0.0, 3.0, 1.0, 1.0]
    adv, _ = compute_group_advantages(torch.tensor(rewards), 2, reward_norm="none", whiten_advantages=True)
    mu, sd = statistics.mean(rewards), statistics.stdev(rewards)
    assert adv.tolist() == pytest.approx([(r - mu) / (sd + EPS) for r in rewards], rel=1e-5)


def test_running_normalisation_tracks_all_rewards_and_checkpoints():
    first, second, third = [0.0, 1.0, 1.0, 1.0], [2.0, 0.5, 0.5, 4.0], [1.0, 2.0, 3.0, 0.0]
    stats = RunningMeanStd()
    adv1, _ = compute_group_advantages(torch.tensor(first), 2, reward_norm="running", running_stats=stats)
    mu, sd = statistics.mean(first), statistics.stdev(first)
    assert adv1.tolist() == pytest.approx([(r - mu) / (sd + EPS) for r in first], rel=1e-5)

    adv2, _ = compute_group_advantages(torch.tensor(second), 2, reward_norm="running", running_stats=stats)
    seen = first + second
    mu, sd = statistics.mean(seen), statistics.stdev(seen)
    assert stats.count == 8
    assert stats.mean == pytest.approx(mu, rel=1e-12)
    assert stats.std == pytest.approx(sd, rel=1e-12)
    assert adv2.tolist() == pytest.approx([(r - mu) / (sd + EPS) for r in second], rel=1e-5)

    restored = RunningMeanStd()
    restored.load_state_dict(stats.state_dict())
    a, _ = compute_group_advantages(torch.tensor(third), 2, reward_norm="running", running_stats=stats)
    b, _ = compute_group_advantages(torch.tensor(third), 2, reward_norm="running", running_stats=restored)
    assert torch.equal(a, b)
    assert restored.state_dict() == stats.state_dict()


@pytest.mark.parametrize(
    "rewards,group_size,options,match",
    [
        (torch.zeros(2, 2), 2, {}, "1-D tensor"),
        (torch.zeros(0), 2, {}, "1-D tensor"),
        ([1.0, 0.0], 2, {}, "1-D tensor"),
        (torch.zeros(5), 2, {}, "do not split into groups of 2"),
        (torch.zeros(4), 0, {}, "group_size must be a positive int"),
        (torch.zeros(4), 1, {}, "group_size >= 2"),
        (torch.zeros(4), 2, {"reward_norm": "whiten"}, "unknown reward_norm 'whiten'; valid: group"),
        (torch.zeros(4), 2, {"reward_norm": None}, "unknown reward_norm None"),
        (torch.zeros(4), 2, {"reward_shift": 1.0}, "reward_shift / reward_scale only apply"),
        (torch.zeros(4), 2, {"reward_norm": "batch", "reward_scale": 2.0}, "cancels them"),
        (torch.zeros(4), 2, {"reward_norm": "none", "reward_scale": 0.0}, "reward_scale must be > 0"),
        (torch.zeros(4), 2, {"reward_norm": "running"}, "running_stats is required"),
        (torch.zeros(4), 2, {"running_stats": RunningMeanStd()}, "running_stats is required"),
        (torch.zeros(4), 2, {"reward_clip": -1.0}, "reward_clip must be > 0"),
        (torch.zeros(4), 2, {"advantage_clip": 0.0}, "advantage_clip must be > 0"),
        (torch.zeros(4), 2, {"eps": -1e-6}, "eps must be >= 0"),
        (torch.zeros(4), 2, {"eps": float("nan")}, "eps must be a finite number"),
        (torch.zeros(4), 2, {"whiten_advantages": 1}, "whiten_advantages must be a bool"),
        (torch.zeros(1), 1, {"reward_norm": "batch"}, "at least 2 rewards"),
        (torch.tensor([0.0, float("nan"), 1.0, 1.0]), 2, {}, r"NaN or inf at index\(es\) \[1\]"),
        (torch.tensor([0.0, 1.0, float("inf"), 1.0]), 2, {}, r"\[2\]"),
    ],
)
def test_bad_advantage_inputs_are_refused(rewards, group_size, options, match):
    with pytest.raises(ValueError, match=match):
        compute_group_advantages(rewards, group_size, **options)


def test_running_mean_std_errors():
    stats = RunningMeanStd()
    with pytest.raises(ValueError, match="at least 2 values"):
        _ = stats.std
    with pytest.raises(ValueError, match="NaN or inf"):
        stats.update(torch.tensor([1.0, float("nan")]))
    assert stats.count == 0  # a rejected update leaves the state untouched
    with pytest.raises(ValueError, match="empty"):
        stats.update(torch.zeros(0))
    with pytest.raises(ValueError, match="must have keys"):
        stats.load_state_dict({"count": 1, "mean": 0.0})
    with pytest.raises(ValueError, match="invalid RunningMeanStd state"):
        stats.load_state_dict({"count": 2, "mean": 0.0, "m2": -1.0})
