"""The same short run under torchrun with EP2 (two gloo workers), micro-batches by count or by a
token budget, with or without megatron's communication overlap, matches a world of one; so do
TP2 and TP2 x EP2 with the MoE load-balancing loss on."""

import os
import subprocess
from pathlib import Path

import pytest
from warm_python import python

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.training.metrics import read_metrics

CONFIG = """
model: {{hf_path: {hf}}}
task: {{name: addition, options: {{min_digits: 1, max_digits: 2, format_reward: 0.5}}}}
sft: {{steps: 20, lr: 3.0e-3, batch_size: 32}}
rollout: {{group_size: 4, rollout_batch_size: 8, max_new_tokens: 4}}
algorithm: {{loss_type: gspo, num_mini_batches: 2}}
optim: {{lr: 5.0e-4}}
trainer: {{steps: 2}}
eval: {{num_problems: 20}}
logging: {{progress_bar: false, tensorboard: false}}
"""


def run(config, run_dir, *extra):
    cmd = [*python(), "-m", "megatron_gspo.cli", "train", "--config", str(config),
           f"trainer.run_dir={run_dir}", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return read_metrics(Path(run_dir, "metrics.jsonl"))


SHORT = ["eval.num_problems=8", "trainer.micro_batch_size=2"]


@pytest.fixture(scope="module")
def run_config(tmp_path_factory):
    """The run config (2 steps) of the module's runs."""
    folder = tmp_path_factory.mktemp("world1")
    hf = make_tiny_hf_checkpoint(folder / "init", tiny(vocab_size=80), seed=5)
    config = folder / "run.yaml"
    config.write_text(CONFIG.format(hf=hf))
    return config


@pytest.fixture(scope="module")
def world_of_one(run_config):
    """The run config and the world of one's records, shared by the EP2 and PP2 tests."""
    return run_config, run(run_config, run_config.parent / "run", *SHORT)


@pytest.mark.multiprocess
def test_ep2_run_matches_world_of_one(tmp_path, world_of_one):
    config, single = world_of_one
    # Megatron's communication overlap (dense gradients reduce-scattered under the backward, the
    # updated shards all-gathered under the next forward): the same run, and the weights each
    # sync sends are the stepped ones (the step-2 rollouts and their mismatch say so).
    overlap = ["parallel.distributed_optimizer=true", "parallel.overlap_grad_reduce=true"]
    overlap += ["parallel.overlap_param_gather=true"]
    ep2 = run(config, tmp_path / "ep2", *SHORT, "parallel.expert_parallel=2", *overlap, "--nproc", "2")
    # Rows of 5..11 tokens under a 24-token budget: several micro-batches per rank, balanced by tokens.
    budget = run(
        config,
        tmp_path / "budget",
        *SHORT,
        "parallel.expert_parallel=2",
        "trainer.micro_batch_size=0",
        "trainer.max_tokens_per_micro_batch=24",
        "--nproc",
        "2",
    )
    for other in (ep2, budget):
        assert [r["step"] for r in other] == [r["step"] for r in single] == [0, 1, 2]
        for a, b in zip(single, other):
            if "eval/accuracy" in a:
                assert b["eval/accuracy"] == a["eval/accuracy"]
            if a["step"] == 0:
                continue
            assert b["rollout/reward_mean"] == a["rollout/reward_mean"]
            # fp32 sums in another order; measured (2-core CPU, gloo): rel <= 5.1e-6 and abs <= 4.8e-7
            # (pg_loss, ~0.008: abs <= 3.9e-8)
            for key in ("actor/pg_loss", "train/grad_norm", "actor/ratio_mean"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
            # both fp32 noise (~1.5e-7 nats): measured apart by <= 3.4e-8
            mismatch = "rollout/logprob_mismatch_mean"
            assert b[mismatch] == pytest.approx(a[mismatch], abs=1e-7), mismatch
    for a, b in zip(ep2[1:], budget[1:]):
        assert b["perf/dp_token_imbalance"] <= a["perf/dp_token_imbalance"]


AUX = ["algorithm.aux_loss_coeff=0.01"]


@pytest.fixture(scope="module")
def aux_world_of_one(run_config):
    """The world of one's records with the MoE load-balancing loss on."""
    return run(run_config, run_config.parent / "aux", *SHORT, *AUX)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [[], ["parallel.expert_parallel=2", "parallel.expert_tensor_parallel=1"]],
    ids=["tp2", "tp2xep2"],
)
def test_tensor_parallel_run_with_the_aux_loss_matches_world_of_one(
    tmp_path, run_config, aux_world_of_one, layout
):
    """TP2 pads every micro-batch to an even length, which TP=1 does not: padding routed and
    counted in the aux loss (per micro-batch, not linear) made the runs differ (measured: pg_loss
    rel 1e-1, grad norm rel 5e-2). Two workers keep DP = 1 (TP2 x EP2 with expert TP 1), so the
    micro-batches hold the same samples and only the padding differs."""
    tp2 = ["parallel.tensor_parallel=2", *layout, "--nproc", "2"]
    staged = run(run_config, tmp_path / "tp2", *SHORT, *AUX, *tp2)
    assert [r["step"] for r in staged] == [r["step"] for r in aux_world_of_one] == [0, 1, 2]
    for a, b in zip(aux_world_of_one[1:], staged[1:]):
        assert a["train/all_zero_adv_batch"] == 0.0 and b["rollout/reward_mean"] == a["rollout/reward_mean"]
        # the aux-off EP2 runs' tolerance; measured (2-core CPU, gloo): rel <= 1.2e-5 at abs <= 5.6e-8
        # (pg_loss ~0.003), grad norm rel <= 8.3e-7
        for key in ("actor/pg_loss", "train/grad_norm", "actor/ratio_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


def assert_follows_world_of_one(single: list[dict], staged: list[dict], steps: list[int]) -> None:
    """A pipelined run's records against the world of one's: same SFT, evaluations, rollouts, updates."""
    assert [r["step"] for r in staged] == [r["step"] for r in single] == steps
    for a, b in zip(single, staged):
        assert b.get("eval/accuracy") == a.get("eval/accuracy")
        if "sft/loss" in a:
            assert b["sft/loss"] == pytest.approx(a["sft/loss"], rel=1e-5)
        if a["step"] == 0:
            continue
        assert b["rollout/reward_mean"] == a["rollout/reward_mean"]  # the synced weights are the trained ones
        assert a["train/all_zero_adv_batch"] == 0.0  # a step that trains
        for key in ("actor/pg_loss", "train/grad_norm", "actor/ratio_mean", "actor/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert b["rollout/logprob_mismatch_mean"] < 1e-5


@pytest.mark.multiprocess
def test_pp2_run_matches_world_of_one(tmp_path, world_of_one):
    """Two pipeline stages (1F1B over the micro-batches, SFT and weight sync included) follow the
    world of one: the same rollouts at step 2 say the synced weights are the trained ones."""
    config, single = world_of_one
    pp2 = run(config, tmp_path / "pp2", *SHORT, "parallel.pipeline_parallel=2", "--nproc", "2")
    assert_follows_world_of_one(single, pp2, steps=[0, 1, 2])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp2_vpp2_run_matches_world_of_one_across_a_resume(tmp_path):
    """Two stages of two model chunks each (interleaved 1F1B; SFT's one micro-batch and RL's
    counts padded for it) follow the world of one, before and after a resume from the step-2
    checkpoint (per-chunk sharded state): the resumed step 3 trains as the world of one's step 3.

    Micro-batches of 6 of a rank's 16 rows: 3 per mini-batch, run as 4 (one zero-loss filler),
    with the MoE aux loss on (RL's algorithm.aux_loss_coeff: the checkpoint's is not used), which
    fillers must not add to."""
    hf = make_tiny_hf_checkpoint(tmp_path / "init", tiny(vocab_size=80, num_layers=4), seed=5)
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.format(hf=hf))
    short = ["eval.num_problems=8", "trainer.micro_batch_size=6", "algorithm.aux_loss_coeff=0.01"]
    vpp = ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2", "--nproc", "2"]
    single = run(config, tmp_path / "world1", *short, "trainer.steps=3")
    run(config, tmp_path / "vpp", *short, "trainer.steps=2", "eval.at_end=false", *vpp)  # as at step 2 of 3
    resumed = run(config, tmp_path / "vpp", *short, "trainer.steps=3", "trainer.resume=true", *vpp)
    assert_follows_world_of_one(single, resumed, steps=[0, 1, 2, 3])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, micro_batch_size, kl", [("r2", 6, False), ("r3", 2, True)])
def test_pp2_vpp2_routing_replay_matches_world_of_one(tmp_path, mode, micro_batch_size, kl):
    """Routing replay keyed by (model chunk, micro-batch): each chunk replays its own layers'
    routes (R2: recorded by that chunk; R3: the rollout's, picked by the chunk's global layers);
    a filler micro-batch (3 real ones run as 4) replays the routes of the one it copies. With the
    KL loss, the reference model is built and copied chunk by chunk."""
    hf = make_tiny_hf_checkpoint(tmp_path / "init", tiny(vocab_size=80, num_layers=4), seed=5)
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.format(hf=hf))
    short = ["eval.num_problems=8", f"trainer.micro_batch_size={micro_batch_size}"]
    short += [f"algorithm.routing_replay={mode}", f"algorithm.use_kl_loss={kl}", "algorithm.kl_loss_coef=0.1"]
    single = run(config, tmp_path / "world1", *short)
    chunked = run(
        config,
        tmp_path / "vpp",
        *short,
        "parallel.pipeline_parallel=2",
        "parallel.virtual_pipeline=2",
        "--nproc",
        "2",
    )
    for a, b in zip(single[1:], chunked[1:]):
        assert a["train/all_zero_adv_batch"] == 0.0 and b["rollout/reward_mean"] == a["rollout/reward_mean"]
        half = a["routing/replay_bytes_per_token"] / 2  # each rank replays half the layers
        assert b["routing/replay_bytes_per_token"] == half
        for key in ("actor/pg_loss", "train/grad_norm", "actor/ratio_mean", *("actor/kl_ref",) * kl):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
