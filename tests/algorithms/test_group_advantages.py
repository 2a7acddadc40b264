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


def test_no_normalisation_keeps_the_rewards():
    adv, _ = compute_group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, reward_norm="none")
    assert adv.tolist() == [1.0, 0.0, 2.0, 2.0]


@pytest.mark.parametrize("norm", ["group", "batch", "running"])
def test_reward_shift_and_scale_are_roll_booleans(norm):
    # ROLL: reward_shift subtracts the mean only, reward_scale divides by the std only.
    rewards = [1.0, 0.0, 4.0, 2.0]
    size = 2 if norm == "group" else 4

    def run(**flag):
        options = {"running_stats": RunningMeanStd()} if norm == "running" else {}
        return compute_group_advantages(torch.tensor(rewards), size, reward_norm=norm, **flag, **options)[0]

    shifted, scaled = run(reward_shift=True), run(reward_scale=True)
    if norm == "group":
        assert shifted.tolist() == pytest.approx([0.5, -0.5, 1.0, -1.0])
        sds = [statistics.stdev([1.0, 0.0])] * 2 + [statistics.stdev([4.0, 2.0])] * 2
        assert scaled.tolist() == pytest.approx([r / (s + EPS) for r, s in zip(rewards, sds)], rel=1e-6)
    else:
        mu, sd = statistics.mean(rewards), statistics.stdev(rewards)
        assert shifted.tolist() == pytest.approx([r - mu for r in rewards])
        assert scaled.tolist() == pytest.approx([r / (sd + EPS) for r in rewards], rel=1e-6)


def test_reward_clip_applies_after_normalising_as_roll():
    # reward_norm none (ROLL's GSPO recipe): the raw rewards are clipped.
    adv, metrics = compute_group_advantages(torch.tensor([15.0, -15.0, 0.0, 1.0]), 4, reward_norm="none",
                                            reward_clip=10.0)  # fmt: skip
    assert adv.tolist() == [10.0, -10.0, 0.0, 1.0]
    assert metrics["rewards/clipfrac"].item() == 0.5
    assert metrics["rewards/mean"].item() == pytest.approx(0.25)  # raw-reward statistics, before clipping
    # After group normalisation: the normalised values are clipped (ROLL's reward_postprocess order).
    adv, _ = compute_group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, reward_clip=1.0)
    assert adv.tolist() == pytest.approx([1.0] + [-0.25 / (0.5 + EPS)] * 3, rel=1e-6)


def test_advantage_clip_and_its_fraction():
    adv, metrics = compute_group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, advantage_clip=1.0)
    assert adv.tolist() == pytest.approx([1.0] + [-0.25 / (0.5 + EPS)] * 3, rel=1e-6)
    assert metrics["advantages/clipfrac"].item() == pytest.approx(0.25)


def roll_masked_whiten(values, lengths):
    """ROLL's masked_whiten over the tokens: each response's value repeated once per token."""
    tokens = [v for v, n in zip(values, lengths) for _ in range(n)]
    mu, var = statistics.mean(tokens), statistics.variance(tokens)
    return [(v - mu) / math.sqrt(var + 1e-8) for v in values]


def test_whitening_is_rolls_token_weighted_masked_whiten():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 1.0, 1.0])
    lengths = [3, 1, 2, 5, 4, 1]
    group_adv, _ = compute_group_advantages(rewards, 3)
    adv, _ = compute_group_advantages(
        rewards, 3, whiten_advantages=True, response_lengths=torch.tensor(lengths)
    )
    assert adv.tolist() == pytest.approx(roll_masked_whiten(group_adv.double().tolist(), lengths), rel=1e-5)
    # Without lengths every response weighs one token.
    adv, _ = compute_group_advantages(rewards, 3, whiten_advantages=True)
    assert adv.tolist() == pytest.approx(roll_masked_whiten(group_adv.double().tolist(), [1] * 6), rel=1e-5)


def test_rolls_gspo_recipe_raw_rewards_whitened_then_clipped():
    # reinforce, reward_norm null, reward_clip 10, whiten_advantages, advantage_clip 2.
    rewards = [0.0, 1.0, 1.0, 12.0, 0.0, 0.0, 1.0, 0.0]
    lengths = [4, 2, 3, 1, 5, 2, 2, 1]
    adv, metrics = compute_group_advantages(
        torch.tensor(rewards), 4, reward_norm="none", reward_clip=10.0, whiten_advantages=True,
        advantage_clip=2.0, response_lengths=torch.tensor(lengths),
    )  # fmt: skip
    expected = [max(-2.0, min(2.0, a)) for a in roll_masked_whiten([min(r, 10.0) for r in rewards], lengths)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-5)
    assert metrics["advantages/clipfrac"].item() == pytest.approx(1 / 8)


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
        (torch.zeros(4), 2, {"reward_shift": 1.0}, "reward_shift must be a bool"),
        (torch.zeros(4), 2, {"reward_shift": True, "reward_scale": True}, "set one"),
        (torch.zeros(4), 2, {"reward_norm": "none", "reward_scale": True}, "nothing to shift or scale"),
        (torch.zeros(4), 2, {"response_lengths": torch.tensor([1, 0, 1, 1])}, "positive counts"),
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
