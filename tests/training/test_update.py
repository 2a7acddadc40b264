"""The update stage on a real tiny Megatron MoE in a world of one: guards, split invariance, mismatch."""

import math

import pytest
import torch

from megatron_gspo.algorithms import compute_group_advantages
from megatron_gspo.config import AlgorithmConfig, RolloutCorrectionConfig
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.logprobs import sequence_logprobs
from megatron_gspo.model.optim import OptimConfig, build_optimizer, wrap_ddp
from megatron_gspo.rollout import RolloutBatch, RolloutSample
from megatron_gspo.training.step.forward import MicroBatch
from megatron_gspo.training.step.update import (
    DataLayout,
    _Mismatch,
    plan_metrics,
    plan_mini_batches,
    recompute_and_measure,
    train_on_batch,
)

G, GROUPS, T = 4, 4, 0.7


@pytest.fixture(scope="module")
def model():
    init_distributed(ParallelConfig(), seed=11)
    ddp = wrap_ddp(build_model(tiny(vocab_size=32), ParallelConfig()))
    yield ddp
    destroy_distributed()


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.module.state_dict().items() if torch.is_tensor(v)}


def restore(model, state):
    with torch.no_grad():
        current = model.module.state_dict()
        for k, v in state.items():
            current[k].copy_(v)


def make_batch(model, shift=0.0, seed=0, max_response=4):
    """Random groups whose rollout log-probs are the model's own (at temperature T) minus `shift`."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for g in range(GROUPS):
        prompt = torch.randint(3, 32, (int(torch.randint(2, 5, (1,), generator=gen)),), generator=gen)
        for _ in range(G):
            size = int(torch.randint(1, max_response + 1, (1,), generator=gen))
            response = torch.randint(3, 32, (size,), generator=gen)
            samples.append(
                RolloutSample(
                    prompt,
                    response,
                    torch.zeros(len(response)),
                    "stop",
                    "0",
                    group_index=g,
                    reward=float(torch.rand((), generator=gen) > 0.5),
                )
            )
    with torch.no_grad():
        own, _ = sequence_logprobs(
            model, [torch.cat([s.prompt_ids, s.response_ids]) for s in samples], temperature=T
        )
    for b, s in enumerate(samples):
        p, r = s.prompt_length, s.response_length
        s.rollout_logprobs = own[b, p : p + r].float() - shift
    batch = RolloutBatch.from_samples(samples, G)
    advantages, _ = compute_group_advantages(batch.rewards, G)
    assert (advantages != 0).any()
    return batch, advantages


def run(
    model, batch, advantages, *, mini=1, micro=0, budget=0, nan_loss=False, old="rollout", lr=1e-2, opt="adam"
):
    optimizer, scheduler = build_optimizer(model, OptimConfig(optimizer=opt, lr=lr, clip_grad=0.0))
    algo = AlgorithmConfig(loss_type="gspo", num_mini_batches=mini, old_logprobs=old)
    layout = DataLayout(micro_batch_size=micro, max_tokens_per_micro_batch=budget)
    plan = plan_mini_batches(batch, advantages, mini, layout)
    extra = recompute_and_measure(model, plan, T) if old == "recompute" else {}
    metrics = train_on_batch(
        model, optimizer, scheduler, plan, algo, temperature=T, max_response_length=4, nan_loss=nan_loss
    )
    return {**metrics, **extra}


def test_non_finite_loss_skips_the_step_with_weights_untouched(model):
    batch, adv = make_batch(model)
    before = snapshot(model)
    metrics = run(model, batch, adv, nan_loss=True)
    assert metrics["train/skipped_steps"] == 1 and metrics["train/optimizer_steps"] == 0
    assert math.isnan(metrics["train/grad_norm"])
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The same batch without the fault does change the weights: the guard, not a no-op, kept them.
    metrics = run(model, batch, adv)
    assert metrics["train/skipped_steps"] == 0 and metrics["train/optimizer_steps"] == 1
    assert any(not torch.equal(before[k], v) for k, v in snapshot(model).items())
    restore(model, before)


def test_nan_only_in_first_mini_batch_skips_one_of_four(model):
    batch, adv = make_batch(model, seed=3)
    before = snapshot(model)
    metrics = run(model, batch, adv, mini=4, nan_loss=True)
    assert metrics["train/skipped_steps"] == 1 and metrics["train/optimizer_steps"] == 3
    restore(model, before)


def test_micro_batch_split_does_not_change_the_update(model):
    batch, adv = make_batch(model, seed=1)
    before = snapshot(model)
    # SGD: the update is linear in the gradient (Adam's first step is ~lr * sign(g), which flips on
    # rounding for near-zero gradient entries).
    whole = run(model, batch, adv, micro=0, opt="sgd")
    after_whole = snapshot(model)
    restore(model, before)
    split = run(model, batch, adv, micro=3, opt="sgd")  # 16 rows -> micro-batches of 3, 3, 3, 3, 3, 1
    after_split = snapshot(model)
    restore(model, before)
    assert split["train/grad_norm"] == pytest.approx(whole["train/grad_norm"], rel=1e-5)
    assert split["actor/pg_loss"] == pytest.approx(whole["actor/pg_loss"], rel=1e-5, abs=1e-7)
    for k in after_whole:
        torch.testing.assert_close(after_split[k], after_whole[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mini", [1, 2])
def test_token_budget_micro_batches_do_not_change_the_update(model, mini):
    # Responses of 1..24 tokens cut by a 40-token budget: micro-batches of different row counts.
    batch, adv = make_batch(model, seed=4, max_response=24)
    layout = DataLayout(max_tokens_per_micro_batch=40)
    plan = plan_mini_batches(batch, adv, mini, layout)
    rows = [micro.packed.num_samples for mini_batch in plan for micro in mini_batch]
    assert len(rows) > 2 * mini and len(set(rows)) > 1
    assert all(micro.packed.tokens.numel() <= 40 for mini_batch in plan for micro in mini_batch)
    before = snapshot(model)
    whole = run(model, batch, adv, mini=mini, opt="sgd")
    after_whole = snapshot(model)
    restore(model, before)
    split = run(model, batch, adv, mini=mini, budget=40, opt="sgd")
    after_split = snapshot(model)
    restore(model, before)
    assert split["train/grad_norm"] == pytest.approx(whole["train/grad_norm"], rel=1e-5)
    assert split["actor/pg_loss"] == pytest.approx(whole["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert any(not torch.equal(after_whole[k], before[k]) for k in before)
    for k in after_whole:
        torch.testing.assert_close(after_split[k], after_whole[k], rtol=1e-5, atol=1e-6)


def test_padding_metrics_count_the_packed_positions(model):
    # Mask layout, one micro-batch of 16 samples of 4..8 tokens (96 in all) in rows of 8, first-fit:
    # only the two 4s share a row -> 15 rows x 8 = 120 positions, 24 of them padding.
    batch, adv = make_batch(model, seed=5)
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    assert sorted(lengths)[:3] == [4, 4, 5] and max(lengths) == 8 and sum(lengths) == 96
    plan = plan_mini_batches(batch, adv, 1, DataLayout())
    assert plan[0][0].packed.tokens.shape == (15, 8)
    metrics = plan_metrics(plan)
    assert metrics["perf/padding_frac"] == pytest.approx(24 / 120)
    assert metrics["perf/dp_token_imbalance"] == 1.0  # a world of one
    one_each = plan_metrics(plan_mini_batches(batch, adv, 1, DataLayout(micro_batch_size=1)))
    assert one_each["perf/padding_frac"] == 0.0  # a sample alone fills its row exactly


def test_mismatch_and_gspo_ratio_against_a_known_shift(model):
    # Rollout log-probs = the trainer's own minus 0.1 on every response token, so before any update
    # |diff| = 0.1 everywhere and every GSPO sequence ratio is exp(mean(0.1)) = exp(0.1).
    batch, adv = make_batch(model, shift=0.1, seed=2)
    before = snapshot(model)
    metrics = run(model, batch, adv, lr=1e-6)
    restore(model, before)
    assert metrics["rollout/logprob_mismatch_mean"] == pytest.approx(0.1, abs=1e-5)
    assert metrics["rollout/logprob_mismatch_max"] == pytest.approx(0.1, abs=1e-5)
    assert metrics["actor/ratio_mean"] == pytest.approx(math.exp(0.1), rel=1e-5)
    assert metrics["actor/clipfrac_seq"] > 0  # exp(0.1) is far outside GSPO's 4e-4 trust region


def test_recompute_uses_the_trainer_as_pi_old(model):
    batch, adv = make_batch(model, shift=0.1, seed=2)
    before = snapshot(model)
    metrics = run(model, batch, adv, old="recompute", lr=1e-6)
    restore(model, before)
    assert metrics["rollout/logprob_mismatch_mean"] == pytest.approx(0.1, abs=1e-5)
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # pi_theta == pi_old before the update
    assert metrics["actor/clipfrac_seq"] == 0.0


# ----------------------------------------------------------------------------- rollout correction


def run_algo(model, batch, advantages, algo, *, lr=1e-6):
    """One step with `algo` (SGD: the update is linear in the gradient), recompute pass included."""
    optimizer, scheduler = build_optimizer(model, OptimConfig(optimizer="sgd", lr=lr, clip_grad=0.0))
    plan = plan_mini_batches(batch, advantages, algo.num_mini_batches, DataLayout())
    extra = recompute_and_measure(model, plan, T) if algo.old_logprobs == "recompute" else {}
    metrics = train_on_batch(model, optimizer, scheduler, plan, algo, temperature=T, max_response_length=4)
    return {**metrics, **extra}


def k3(d):
    return math.exp(d) - 1 - d


def test_sequence_tis_with_gspo_end_to_end(model):
    # Rollout log-probs = the trainer's own - 0.1: pi_old / pi_rollout = e^0.1 ~ 1.105 on every token,
    # so the geometric mean of every response is e^0.1 and a cap of 1.05 truncates all of them to
    # w = 1.05: the gradient is exactly 1.05 times the uncorrected one.
    batch, adv = make_batch(model, shift=0.1, seed=4)
    before = snapshot(model)
    plain = run_algo(
        model, batch, adv, AlgorithmConfig(loss_type="gspo", num_mini_batches=1, old_logprobs="recompute")
    )
    restore(model, before)
    algo = AlgorithmConfig(
        loss_type="gspo",
        num_mini_batches=1,
        old_logprobs="recompute",
        rollout_correction=RolloutCorrectionConfig(method="tis", level="sequence", cap=1.05),
    )
    corrected = run_algo(model, batch, adv, algo)
    restore(model, before)
    assert corrected["train/grad_norm"] == pytest.approx(1.05 * plain["train/grad_norm"], rel=1e-5)
    assert corrected["rollout_corr/truncfrac_seq"] == 1.0
    assert corrected["rollout_corr/truncfrac_tokens"] == 1.0
    assert corrected["rollout_corr/weight_mean"] == pytest.approx(1.05, rel=1e-6)
    assert corrected["rollout_corr/weight_max"] == pytest.approx(1.05, rel=1e-6)
    assert corrected["rollout/k3_kl"] == pytest.approx(k3(0.1), rel=1e-4)
    assert corrected["actor/clipfrac_seq_first_mb"] == 0.0  # pi_theta == pi_old before the update
    assert "actor/clipfrac_seq_later_mbs" not in corrected  # one mini-batch
    assert "rollout_corr/weight_mean" not in plain
    assert all(math.isfinite(v) for v in corrected.values())


def test_token_icepop_with_grpo_end_to_end_masks_nothing_inside_the_band(model):
    # rho = e^0.1 on every token, inside IcePop's [0.5, 5]: w = e^0.1 everywhere, nothing masked;
    # a band ending at 1.1 < e^0.1 masks every token and leaves no gradient.
    batch, adv = make_batch(model, shift=0.1, seed=4)
    before = snapshot(model)
    grpo = {"loss_type": "grpo", "num_mini_batches": 2, "old_logprobs": "recompute"}
    plain = run_algo(model, batch, adv, AlgorithmConfig(**grpo))
    restore(model, before)
    icepop = run_algo(
        model, batch, adv, AlgorithmConfig(**grpo, rollout_correction=RolloutCorrectionConfig("icepop"))
    )
    restore(model, before)
    masked = RolloutCorrectionConfig("icepop", high=1.1)
    dropped = run_algo(model, batch, adv, AlgorithmConfig(**grpo, rollout_correction=masked))
    restore(model, before)
    assert icepop["rollout_corr/maskfrac_tokens"] == 0.0 and icepop["rollout_corr/maskfrac_seq"] == 0.0
    assert icepop["rollout_corr/weight_mean"] == pytest.approx(math.exp(0.1), rel=1e-5)
    assert icepop["train/grad_norm"] == pytest.approx(math.exp(0.1) * plain["train/grad_norm"], rel=1e-4)
    assert dropped["rollout_corr/maskfrac_tokens"] == 1.0 and dropped["rollout_corr/weight_max"] == 0.0
    assert dropped["train/grad_norm"] == 0.0
    for key in ("actor/clipfrac_seq_first_mb", "actor/clipfrac_seq_later_mbs", "rollout/k3_kl"):
        assert math.isfinite(icepop[key])


def test_mismatch_by_length_and_first_mini_batch_clipfrac_with_rollout_logprobs(model):
    # pi_old = the rollout's log-probs = the trainer's - 0.1: before any update every GSPO ratio is
    # e^0.1 > 1 + 4e-4, clipped exactly for the responses with A > 0 (first mini-batch = rows 0-7).
    batch, adv = make_batch(model, shift=0.1, seed=5)
    before = snapshot(model)
    metrics = run(model, batch, adv, mini=2, lr=1e-6)
    restore(model, before)
    assert metrics["actor/clipfrac_seq_first_mb"] == pytest.approx(float((adv[:8] > 0).float().mean()))
    assert 0.0 <= metrics["actor/clipfrac_seq_later_mbs"] <= 1.0
    assert metrics["rollout/k3_kl"] == pytest.approx(k3(0.1), rel=1e-4)
    lengths = batch.response_lengths[:8].tolist()  # measured in the first mini-batch's forward only
    expected = {
        "1": sum(n == 1 for n in lengths),
        "2-3": sum(n in (2, 3) for n in lengths),
        "4-7": sum(n == 4 for n in lengths),
    }
    for bucket, count in expected.items():
        prefix = f"rollout/mismatch_by_len/{bucket}/"
        if count == 0:
            assert prefix + "num_seqs" not in metrics
            continue
        assert metrics[prefix + "num_seqs"] == count
        assert metrics[prefix + "abs_diff_mean"] == pytest.approx(0.1, abs=1e-5)
        assert metrics[prefix + "log_seq_ratio_mean"] == pytest.approx(0.1, abs=1e-5)
        assert metrics[prefix + "k3_kl"] == pytest.approx(k3(0.1), rel=1e-4)
    assert sum(expected.values()) == 8 and sum(c > 0 for c in expected.values()) >= 2


def test_mismatch_metrics_of_a_hand_made_batch():
    # Trainer - rollout: row 0 [-0.2]; row 1 [0.1, -0.3, 0.2]; row 2 [0.4, 0.0], in two micro-batches.
    def micro(diffs):
        width = max(len(d) for d in diffs)
        mask = torch.tensor([[t < len(d) for t in range(width)] for d in diffs])
        rollout = torch.where(mask, -1.5, 0.0)
        trainer = rollout + torch.tensor([d + [0.0] * (width - len(d)) for d in diffs])
        micro = MicroBatch([], None, mask, rollout.clone(), rollout, torch.zeros(len(diffs)))
        return trainer, micro

    mismatch = _Mismatch(torch.device("cpu"))
    for diffs in ([[-0.2]], [[0.1, -0.3, 0.2], [0.4, 0.0]]):
        mismatch.add(*micro(diffs))
    out = mismatch.reduce(group=None)
    flat = [-0.2, 0.1, -0.3, 0.2, 0.4, 0.0]
    assert out["rollout/logprob_mismatch_mean"] == pytest.approx(1.2 / 6, abs=1e-6)
    assert out["rollout/logprob_mismatch_max"] == pytest.approx(0.4, abs=1e-6)
    assert out["rollout/k3_kl"] == pytest.approx(sum(k3(d) for d in flat) / 6, rel=1e-5)
    one, two_three = "rollout/mismatch_by_len/1/", "rollout/mismatch_by_len/2-3/"
    assert out[one + "num_seqs"] == 1 and out[two_three + "num_seqs"] == 2
    assert out[one + "abs_diff_mean"] == pytest.approx(0.2, abs=1e-6)
    assert out[one + "log_seq_ratio_mean"] == pytest.approx(-0.2, abs=1e-6)
    assert out[one + "k3_kl"] == pytest.approx(k3(-0.2), rel=1e-5)
    assert out[two_three + "abs_diff_mean"] == pytest.approx(1.0 / 5, abs=1e-6)
    assert out[two_three + "log_seq_ratio_mean"] == pytest.approx((0.0 / 3 + 0.4 / 2) / 2, abs=1e-6)
    assert out[two_three + "k3_kl"] == pytest.approx(sum(k3(d) for d in flat[1:]) / 5, rel=1e-5)
    assert not any("/4-7/" in k for k in out)  # empty buckets are not reported


def test_ppo_epochs_pass_over_the_batch_again(model):
    batch, adv = make_batch(model, seed=6)
    before = snapshot(model)
    optimizer, scheduler = build_optimizer(model, OptimConfig(optimizer="sgd", lr=1e-2, clip_grad=0.0))
    algo = AlgorithmConfig(loss_type="gspo", num_mini_batches=2, ppo_epochs=3, old_logprobs="recompute")
    plan = plan_mini_batches(batch, adv, 2, DataLayout())
    recompute_and_measure(model, plan, T)
    metrics = train_on_batch(model, optimizer, scheduler, plan, algo, temperature=T, max_response_length=4)
    restore(model, before)
    assert metrics["train/optimizer_steps"] == 6.0  # 3 passes x 2 mini-batches
    assert metrics["actor/clipfrac_seq_first_mb"] == 0.0  # only the very first mini-batch is pi_old's
    assert metrics["actor/ratio_max"] > 1.0
