"""`megatron-gspo parity`: TP/EP/PP layouts equal TP=EP=PP=1 (log-probs and one optimizer step).

Pipeline layouts run megatron's 1F1B schedule with several micro-batches in flight (and, in
one case, full activation recompute); the reference runs the no-pipelining schedule.

fp32: differences are reduction-order noise, ~1e-6. bf16 (megatron's mixed precision): the
layout rounds its partial sums to bf16 in another order than TP=1, so it differs from TP=1 by
as much as bf16 rounding itself changes the log-probs (both are one bf16 rounding path of
the same computation; measured mean |d| 1.8e-3 for TP2 vs 3.1e-3 for bf16 vs fp32), far
above fp32's 1e-5. The bound is `BF16_FACTOR` (2) x that bf16-vs-fp32 distance, measured in
the same run; the negative controls inject sharding bugs (a swapped expert pair as a wrong
EP mapping, one expert's TP slices exchanged) that must fail on the log-probs alone, and a
missing data-parallel loss factor that only the grad-norm bound sees.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest
from forked_torchrun import torchrun
from warm_python import python

from megatron_gspo.analysis.parity import BF16_FACTOR, BF16_GRAD_NORM_REL, BF16_WEIGHT_MEAN

pytestmark = pytest.mark.multiprocess

LINE = re.compile(
    r"max\|dlogprob\|=(\S+) max\|dweight\| after one (?:linear )?Adam step=(\S+) grad_norm (\S+) vs (\S+)"
)
BF16 = re.compile(
    r"\(rel (\S+)\) mean\|dlogprob\|=(\S+) mean\|dweight\|=(\S+); "
    r"bf16 vs fp32 at tp=1: max\|dlogprob\|=(\S+) mean\|dlogprob\|=(\S+)"
)
BUG_WORKER = Path(__file__).with_name("parity_bug_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def parity(*args):
    cmd = [*python(), "-m", "megatron_gspo.cli", "parity", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)


def bf16_figures(stdout: str) -> dict[str, float]:
    head, tail = LINE.search(stdout), BF16.search(stdout)
    assert head and tail, stdout
    logprob_max, weight_max, grad_norm, ref_norm = map(float, head.groups())
    grad_norm_rel, logprob_mean, weight_mean, rounding_max, rounding_mean = map(float, tail.groups())
    assert grad_norm > 0 and rounding_mean > 0
    return dict(
        logprob_max=logprob_max,
        logprob_mean=logprob_mean,
        weight_mean=weight_mean,
        grad_norm_rel=grad_norm_rel,
        rounding_max=rounding_max,
        rounding_mean=rounding_mean,
    )


@pytest.mark.parametrize(
    "args",
    [
        ("--tp", "2", "--ep", "2"),
        ("--tp", "2", "--ep", "1"),
        ("--tp", "1", "--ep", "2", "--dispatcher", "allgather", "--distributed-optimizer"),
        ("--tp", "1", "--ep", "1", "--pp", "2"),
        ("--tp", "1", "--ep", "2", "--pp", "2", "--recompute"),
    ],
    ids=["tp2xep2", "tp2", "ep2-allgather-distopt", "pp2", "pp2xep2-recompute"],
)
def test_layout_matches_world_one(args):
    result = parity(*args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    match = LINE.search(result.stdout)
    assert match, result.stdout
    logprob_diff, weight_diff, grad_norm, ref_norm = map(float, match.groups())
    assert logprob_diff <= 1e-5 and weight_diff <= 1e-5
    assert abs(grad_norm - ref_norm) <= 1e-5 and grad_norm > 0


@pytest.mark.slow  # three processes, ~40-70 s on a shared 2-core box
def test_uneven_three_stage_pipeline_matches_world_one():
    """6 layers as 1 + 2 + 3 over three stages (megatron's first/last stage layers) vs PP=1."""
    uneven = ("--pp", "3", "--num-layers", "6", "--first-stage-layers", "1", "--last-stage-layers", "3")
    result = parity("--tp", "1", "--ep", "1", *uneven)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "pp=3 stages=[1, 2, 3] " in result.stdout and "(6 layers," in result.stdout
    logprob_diff, weight_diff, grad_norm, ref_norm = map(float, LINE.search(result.stdout).groups())
    assert logprob_diff <= 1e-5 and weight_diff <= 1e-5
    assert abs(grad_norm - ref_norm) <= 1e-5 and grad_norm > 0


@pytest.mark.slow  # the interleaved schedule on two processes, ~60 s on a shared 2-core box
def test_virtual_pipeline_matches_world_one():
    """PP2 x 2 chunks of a 4-layer model (stage 0: layers 0 and 2, stage 1: 1 and 3), interleaved 1F1B."""
    result = parity("--tp", "1", "--ep", "1", "--pp", "2", "--vpp", "2", "--num-layers", "4")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "pp=2 vpp=2 chunks=[[0, 2], [1, 3]] " in result.stdout
    logprob_diff, weight_diff, grad_norm, ref_norm = map(float, LINE.search(result.stdout).groups())
    assert logprob_diff <= 1e-5 and weight_diff <= 1e-5
    assert abs(grad_norm - ref_norm) <= 1e-5 and grad_norm > 0


def test_refuses_a_pipeline_split_megatron_refuses():
    result = parity("--tp", "1", "--ep", "1", "--pp", "3", "--num-layers", "6", "--first-stage-layers", "1")
    assert result.returncode == 2
    assert "parallel.first_stage_layers=1 leaves 5 of the 6 layers, not divisible by the 2" in result.stderr


def test_exits_non_zero_above_the_tolerance():
    # TP=2 splits reductions differently: diffs are ~1e-6, never exactly 0 (checked in the line).
    result = parity("--tp", "2", "--ep", "1", "--tolerance", "0")
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    assert [line for line in result.stdout.splitlines() if "FAIL" in line] == [result.stdout.strip()]
    # the line is the answer: no torchrun failure report about the workers' exit status
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    "layout", [("--tp", "2", "--ep", "1"), ("--tp", "1", "--ep", "2")], ids=["tp2", "ep2"]
)
def test_bf16_layout_matches_world_one_within_bf16_rounding(layout):
    result = parity(*layout, "--dtype", "bf16")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    f = bf16_figures(result.stdout)
    assert f["logprob_mean"] <= BF16_FACTOR * f["rounding_mean"]
    assert f["logprob_max"] <= BF16_FACTOR * f["rounding_max"]
    assert f["weight_mean"] <= BF16_WEIGHT_MEAN and f["grad_norm_rel"] <= BF16_GRAD_NORM_REL
    if layout[1] == "2":  # TP2 rounds partial sums in another order: bf16-sized, never 0
        assert f["logprob_mean"] > 1e-4
    else:  # EP moves whole experts: the same sums in the same order
        assert f["logprob_max"] == 0.0


def test_fp32_gradients_catch_a_sharding_bug():
    """The fp32 check compares a linear Adam step (the gradients): a swapped expert still fails it."""
    cmd = [*torchrun(2, BUG_WORKER), "expert_swap", "--tp", "1", "--ep", "2"]
    result = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (
        "FAIL: log-probs, grad norm, gradients (the linear Adam step, relative to its largest)"
        in result.stdout
    )


@pytest.mark.parametrize(
    "bug,layout",
    [("expert_swap", ("--tp", "1", "--ep", "2")), ("tp_slice_swap", ("--tp", "2", "--ep", "1"))],
)
def test_bf16_bound_catches_a_sharding_bug(bug, layout):
    cmd = [*torchrun(2, BUG_WORKER), bug, *layout, "--dtype", "bf16"]
    result = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and "FAIL" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    f = bf16_figures(result.stdout)
    assert f["logprob_mean"] > BF16_FACTOR * f["rounding_mean"]  # the log-probs alone catch it


def test_bf16_bound_catches_an_unscaled_data_parallel_loss():
    """EP2 runs two data-parallel ranks: without the DP loss factor the gradients are halved. The
    first Adam step is invariant to the scale, so only the grad-norm bound can catch it."""
    cmd = [*torchrun(2, BUG_WORKER), "unscaled_dp_loss", "--tp", "1", "--ep", "2", "--dtype", "bf16"]
    result = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and "FAIL" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    f = bf16_figures(result.stdout)
    assert f["grad_norm_rel"] == pytest.approx(0.5, abs=0.01)
    assert f["logprob_max"] == 0.0 and f["weight_mean"] <= BF16_WEIGHT_MEAN


def test_bf16_refuses_an_fp32_tolerance():
    result = parity("--tp", "2", "--ep", "1", "--dtype", "bf16", "--tolerance", "0.1")
    assert result.returncode == 2 and "--tolerance applies to --dtype fp32" in result.stderr


def test_layout_on_the_users_own_checkpoint(tmp_path):
    """`--hf-path`: the layout is checked on the checkpoint's architecture and weights; a layout
    that does not divide it is refused by name before any worker starts."""
    from megatron_gspo.model.config import tiny
    from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint

    hf = make_tiny_hf_checkpoint(
        tmp_path / "hf", tiny(vocab_size=90, num_layers=3, num_experts=6, init_std=0.2)
    )
    result = parity("--tp", "1", "--ep", "2", "--hf-path", str(hf))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert (
        f"parity tp=1 ep=2 pp=1 dispatcher=alltoall dtype=fp32 world=2 on {hf} "
        "(3 layers, 6 experts top-2, vocab 90)" in result.stdout
    )
    logprob_diff, weight_diff, grad_norm, ref_norm = map(float, LINE.search(result.stdout).groups())
    assert logprob_diff <= 1e-5 and weight_diff <= 1e-5 and abs(grad_norm - ref_norm) <= 1e-5
    refused = parity("--tp", "1", "--ep", "4", "--hf-path", str(hf))
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        f"megatron-gspo parity: config error: --ep 4 does not divide the 6 experts of --hf-path {hf}"
    )


@pytest.mark.parametrize(
    "vocab,layout",
    [(600, ("--ep", "2")), (601, ("--ep", "1", "--pp", "2"))],
    ids=["tp2xep2", "tp2xpp2-odd-vocab"],
)
def test_a_healthy_layout_passes_on_a_user_like_checkpoint(tmp_path, vocab, layout):
    """An untied vocabulary at TP2 x EP2 / TP2 x PP2 with transformers' default router_aux_loss_coef.

    An Adam step flipped near-zero gradients' weights by 2 lr under the layout's reduction order
    (max|dweight| 1.07e-5 > 1e-5: a false FAIL); the linear Adam step compares the gradients
    themselves. The aux loss (0.001) counted padding and the two runs held other micro-batches:
    step rel 2.9e-3 at TP2 x EP2 and 3.2e-3 at TP2 x PP2 (where the second stage gets its
    sequence-parallel slice of the padding mask). An odd vocabulary is padded at TP2 (601 -> 602
    rows), and the TP=1 reference pads it alike (it crashed loading 601 rows into 602)."""
    from megatron_gspo.model.config import tiny
    from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint

    arch = tiny(vocab_size=vocab, tie_word_embeddings=False, aux_loss_coeff=0.001)
    hf = make_tiny_hf_checkpoint(tmp_path / "hf", arch, seed=3)
    result = parity("--tp", "2", *layout, "--hf-path", str(hf))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "after one linear Adam step" in result.stdout and "-> OK" in result.stdout
    assert f"vocab {vocab}) aux_loss_coeff=0.001 (the model's router_aux_loss_coef) vs" in result.stdout
    logprob_diff, weight_diff, grad_norm, ref_norm = map(float, LINE.search(result.stdout).groups())
    assert abs(grad_norm - ref_norm) <= 1e-5 and grad_norm > 0
