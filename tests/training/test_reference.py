"""The KL loss's reference model on a real tiny Megatron MoE in a world of one.

The reference is a frozen copy of the policy: before the first update its log-probs equal the
policy's bit for bit (KL exactly 0), it never changes, it holds no gradients; the KL term's
value and gradient match a hand computation from the two models' own log-probs; a copy exported
for a resume gives the same log-probs bit for bit.
"""

import math

import pytest
import torch

from megatron_gspo.config import AlgorithmConfig
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.engine import EngineConfig
from megatron_gspo.model.logprobs import sequence_logprobs
from megatron_gspo.model.optim import OptimConfig, build_optimizer, wrap_ddp
from megatron_gspo.rollout import RolloutBatch, RolloutSample
from megatron_gspo.training.reference import ReferenceDamagedError, ReferencePolicy
from megatron_gspo.training.step.update import (
    DataLayout,
    plan_mini_batches,
    recompute_and_measure,
    train_on_batch,
)

G, GROUPS, T = 4, 2, 0.7
MODEL = tiny(vocab_size=32)


@pytest.fixture(scope="module")
def models():
    init_distributed(ParallelConfig(), seed=5)
    reference = ReferencePolicy(MODEL, ParallelConfig(), EngineConfig())  # built first, as the trainer does
    policy = wrap_ddp(build_model(MODEL, ParallelConfig()))
    yield policy, reference
    destroy_distributed()


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def restore(module, state):
    with torch.no_grad():
        for k, v in module.named_parameters():
            v.copy_(state[k])


def make_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for g in range(GROUPS):
        prompt = torch.randint(3, 32, (3,), generator=gen)
        for i in range(G):
            response = torch.randint(3, 32, (1 + (i + g) % 4,), generator=gen)
            zeros = torch.zeros(len(response))
            samples.append(
                RolloutSample(prompt, response, zeros, "stop", "0", group_index=g, reward=float(i % 2))
            )
    return RolloutBatch.from_samples(samples, G)


def algo(**kwargs):
    return AlgorithmConfig(loss_type="gspo", old_logprobs="recompute", use_kl_loss=True, **kwargs)


def test_reference_equals_the_policy_until_the_first_update(models):
    policy, reference = models
    start = snapshot(policy.module)
    reference.copy_from(policy)
    batch = make_batch()
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0] * GROUPS)
    optimizer, scheduler = build_optimizer(policy, OptimConfig(lr=1e-2, clip_grad=0.0))
    plan = plan_mini_batches(batch, advantages, 2, DataLayout())
    recompute_and_measure(policy, plan, T, reference=reference)  # fused: one loop, two models
    assert all(torch.equal(mb.ref_logprobs, mb.old_logprobs) for mini in plan for mb in mini)
    reference.fill_plan(plan, T)  # alone (no pi_old pass): one schedule run over all micro-batches
    assert all(torch.equal(mb.ref_logprobs, mb.old_logprobs) for mini in plan for mb in mini)
    metrics = train_on_batch(
        policy, optimizer, scheduler, plan, algo(num_mini_batches=2), temperature=T, max_response_length=4
    )
    assert metrics["actor/kl_ref_first_mb"] == 0.0  # the policy still is the reference
    assert metrics["actor/kl_ref_later_mbs"] > 0.0  # one optimizer step later it is not
    assert metrics["actor/kl_loss"] > 0.0
    for name, param in reference.model.named_parameters():  # frozen: same values, no gradient
        assert torch.equal(param, start[name]) and param.grad is None and not param.requires_grad
    assert not reference.model.training
    moved = max(float((p.detach() - start[k]).abs().max()) for k, p in policy.module.named_parameters())
    assert moved > 1e-4
    restore(policy.module, start)


def kl_by_hand(d: torch.Tensor, estimator: str) -> torch.Tensor:
    """Schulman's estimators written out, d = log pi_theta - log pi_ref."""
    if estimator == "k1":
        return d
    if estimator == "k2":
        return d * d / 2
    return torch.exp(-d) - 1 + d


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_value_and_gradient_against_a_hand_computation(models, estimator):
    policy, reference = models
    start = snapshot(policy.module)
    reference.copy_from(policy)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a reference some distance from the policy
        for param in reference.model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    batch = make_batch(seed=3)
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    sequences = [batch.tokens[b, :n] for b, n in enumerate(lengths)]
    mask = batch.response_mask[:, : max(lengths)].bool()
    coef, lr = 0.5, 0.1

    # By hand: the two models' own log-probs, each estimator's formula, seq-mean-token-mean.
    params = [p for p in policy.module.parameters()]
    logprobs, _ = sequence_logprobs(policy.module, sequences, temperature=T)
    with torch.no_grad():
        ref_logprobs, _ = sequence_logprobs(reference.model, sequences, temperature=T)
    per_token = kl_by_hand((logprobs - ref_logprobs).double(), estimator) * mask
    expected = coef * (per_token.sum(-1) / mask.sum(-1)).mean()
    grads = torch.autograd.grad(expected, params, allow_unused=True)
    expected_kl = float(per_token.sum() / mask.sum())

    # Zero advantages: GSPO's term is 0 with zero gradient, the update is the KL term's alone.
    optimizer, scheduler = build_optimizer(policy, OptimConfig(optimizer="sgd", lr=lr, clip_grad=0.0))
    plan = plan_mini_batches(batch, torch.zeros(batch.batch_size), 1, DataLayout(micro_batch_size=3))
    recompute_and_measure(policy, plan, T, reference=reference)
    metrics = train_on_batch(
        policy,
        optimizer,
        scheduler,
        plan,
        algo(num_mini_batches=1, kl_loss_coef=coef, kl_estimator=estimator),
        temperature=T,
        max_response_length=4,
    )
    assert metrics["actor/kl_loss"] == pytest.approx(float(expected), rel=1e-5)
    assert metrics["actor/kl_ref"] == pytest.approx(expected_kl, rel=1e-4, abs=1e-7)
    assert metrics["actor/pg_loss"] == 0.0
    if estimator != "k1":
        assert expected_kl > 1e-4  # the reference really differs
    worst = scale = 0.0
    for (name, param), grad in zip(policy.module.named_parameters(), grads, strict=True):
        step = (start[name] - param.detach()) / lr
        hand = torch.zeros_like(step) if grad is None else grad.float()
        worst, scale = max(worst, float((step - hand).abs().max())), max(scale, float(hand.abs().max()))
    assert scale > 1e-4 and worst <= 1e-4 * scale
    restore(policy.module, start)


def test_a_reference_exported_for_resume_gives_the_same_logprobs(models, tmp_path):
    policy, reference = models
    source = reference.initialise(
        policy, ref_hf_path=None, policy_hf_path=None, run_dir=tmp_path, resumed=False, on_disk=False
    )
    assert source == "the policy's starting weights" and (tmp_path / "reference" / "config.json").is_file()
    sequences = [torch.arange(3, 12), torch.arange(5, 9)]
    with torch.no_grad():
        before, _ = sequence_logprobs(reference.model, sequences, temperature=T)
        restored = ReferencePolicy(MODEL, ParallelConfig(), EngineConfig())
        assert restored.initialise(
            policy, ref_hf_path=None, policy_hf_path=None, run_dir=tmp_path, resumed=True, on_disk=False
        ) == str(tmp_path / "reference")
        after, _ = sequence_logprobs(restored.model, sequences, temperature=T)
    assert torch.equal(before, after)
    with pytest.raises(FileNotFoundError, match="model.ref_hf_path"):
        ReferencePolicy(MODEL, ParallelConfig(), EngineConfig()).initialise(
            policy, ref_hf_path=None, policy_hf_path=None, run_dir=tmp_path / "x", resumed=True, on_disk=False
        )


def test_a_damaged_saved_reference_is_refused_by_name(models, tmp_path):
    """Flipped bytes in the run's saved reference never load silently (actor/kl_ref would jump)."""
    policy, reference = models
    reference.initialise(
        policy, ref_hf_path=None, policy_hf_path=None, run_dir=tmp_path, resumed=False, on_disk=False
    )
    weights = tmp_path / "reference" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1000:] = bytes(b ^ 0xFF for b in data[-1000:])
    weights.write_bytes(bytes(data))
    with pytest.raises(
        ReferenceDamagedError, match=r"reference model \(KL loss\) is damaged: .*model.safetensors differs"
    ):
        ReferencePolicy(MODEL, ParallelConfig(), EngineConfig()).initialise(
            policy, ref_hf_path=None, policy_hf_path=None, run_dir=tmp_path, resumed=True, on_disk=False
        )


def test_offload_is_a_no_op_on_cpu(models):
    assert not torch.cuda.is_available()
    offloaded = ReferencePolicy(MODEL, ParallelConfig(), EngineConfig(), offload=True)
    assert not offloaded.offload
    offloaded.start_offloaded()
    with offloaded.on_device():
        assert all(p.device.type == "cpu" for p in offloaded.model.parameters())
    assert math.isfinite(sum(float(p.sum()) for p in offloaded.model.parameters()))


# reward_clip 0.25 clips the last token's reward (R +- the KL term) of six rows and, as ROLL clips
# every token's, three earlier tokens' -beta kl (two of row 6, one of row 2; |.| 0.29 to 0.59).
@pytest.mark.parametrize("reward_clip", [None, 0.25])
def test_token_level_kl_advantages_against_a_hand_computation(models, reward_clip):
    from megatron_gspo.algorithms.token_kl import KLController
    from megatron_gspo.training.step.token_kl import apply_token_level_kl

    policy, reference = models
    start = snapshot(policy.module)
    reference.copy_from(policy)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in reference.model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    batch = make_batch(seed=4)
    rewards = batch.rewards.float()
    beta, clip = 0.5, 1.5
    plan = plan_mini_batches(batch, rewards, 2, DataLayout(micro_batch_size=3))
    recompute_and_measure(policy, plan, T, reference=reference)
    algo = AlgorithmConfig(loss_type="gspo_token", num_mini_batches=2, old_logprobs="recompute",
                           add_token_level_kl=True, init_kl_coef=beta, whiten_advantages=True,
                           advantage_clip=clip, reward_clip=reward_clip)  # fmt: skip
    controller = KLController(beta)
    metrics = apply_token_level_kl(policy, plan, algo, controller, None)

    # By hand, over the whole batch: k1 = log pi_old - log pi_ref, R on the last token, returns,
    # the token rewards clipped (reward_clip), ROLL's masked_whiten over all response tokens, clip.
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    sequences = [batch.tokens[b, :n] for b, n in enumerate(lengths)]
    mask = batch.response_mask[:, : max(lengths)].bool()
    with torch.no_grad():
        old, _ = sequence_logprobs(policy.module, sequences, temperature=T)
        ref, _ = sequence_logprobs(reference.model, sequences, temperature=T)
    kl = ((old - ref).double() * mask).tolist()
    expected, values, seq_kls, clipped_before_last = [], [], [], 0
    for b in range(len(sequences)):
        cols = [t for t in range(mask.shape[1]) if mask[b, t]]
        token_rewards = [-beta * kl[b][t] for t in cols]
        token_rewards[-1] += float(rewards[b])
        if reward_clip is not None:
            clipped_before_last += sum(abs(r) > reward_clip for r in token_rewards[:-1])
            token_rewards = [max(-reward_clip, min(reward_clip, r)) for r in token_rewards]
        returns = [sum(token_rewards[i:]) for i in range(len(cols))]
        expected.append(returns)
        values += returns
        seq_kls.append(sum(kl[b][t] for t in cols) / len(cols))
    assert clipped_before_last >= (0 if reward_clip is None else 2)  # the clip reaches inner tokens
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    expected = [[max(-clip, min(clip, (v - mean) / math.sqrt(var + 1e-8))) for v in row] for row in expected]
    for mini in plan:
        for micro in mini:
            for row, b in enumerate(micro.indices):
                got = micro.advantages[row][micro.response_mask[row]].tolist()
                assert got == pytest.approx(expected[b], abs=2e-5), b
    assert metrics["critic/kl"] == pytest.approx(sum(seq_kls) / len(seq_kls), abs=1e-6)
    assert metrics["critic/kl_coef"] == beta and abs(metrics["critic/kl"]) > 1e-4
    optimizer, scheduler = build_optimizer(policy, OptimConfig(optimizer="sgd", lr=1e-3, clip_grad=0.0))
    out = train_on_batch(policy, optimizer, scheduler, plan, algo, temperature=T, max_response_length=4)
    assert out["train/optimizer_steps"] == 2.0 and math.isfinite(out["actor/pg_loss"])
    restore(policy.module, start)
