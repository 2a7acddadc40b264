"""Every runtime patch: applies on this megatron-core, is refused or skipped elsewhere, and is still needed.

The "still needed" tests run a small train step with one patch left out and expect the
exact upstream failure the patch exists for, at the upstream call site it patches. When
upstream fixes one, its test fails loudly: then narrow the patch's version range (or delete
it). A patch with `fixed_in` at or below the installed version must instead run fine.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from megatron_gspo.patches import PATCHES, PatchError, apply_patches, megatron_core_version

REPRODUCE = Path(__file__).with_name("reproduce.py")
BY_NAME = {patch.name: patch for patch in PATCHES}
needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches only apply without CUDA")
INSTALLED = megatron_core_version()
# What touching CUDA raises without a GPU: the CPU torch wheel (Python 3.11 here) says it was
# not compiled with CUDA; the CUDA wheel (Python 3.12 here) on a machine without a driver says so.
NO_CUDA = (
    r"(Torch not compiled with CUDA enabled|Found no NVIDIA driver on your system"
    r"|torch\.cuda\.Stream requires CUDA support|CUDA driver version is insufficient"
    r"|no CUDA-capable device is detected)"
)


def fixed_upstream(name: str) -> bool:
    fixed_in = BY_NAME[name].fixed_in
    return fixed_in is not None and INSTALLED >= fixed_in


def start_without(patch: str, nproc: int = 1, tp: int = 1, ep: int = 1, *extra: str) -> subprocess.Popen:
    # faulthandler: a rank that gloo aborts from its C++ side (no Python traceback) still prints
    # every thread's Python stack, so a test can tell where it was
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    args = [str(REPRODUCE), patch, "--tp", str(tp), "--ep", str(ep), *extra]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            *args,
        ]
    else:
        cmd = [sys.executable, *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> tuple[int, str]:
    output, _ = process.communicate(timeout=600)
    return process.returncode, output


@needs_cpu
def test_every_patch_applies_on_the_installed_version_unless_fixed_upstream():
    decisions = apply_patches()
    assert set(decisions) == set(BY_NAME)
    for name, decision in decisions.items():
        if fixed_upstream(name):
            assert decision == f"skipped: fixed upstream in megatron-core {BY_NAME[name].fixed_in}"
        else:
            assert decision == "applied", (name, decision)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_installed_version_is_verified_or_fixed_upstream(name):
    assert INSTALLED in BY_NAME[name].verified or fixed_upstream(name), (name, str(INSTALLED))


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_upstream_anchors_are_where_each_patch_expects_them(name):
    BY_NAME[name].check()


def test_version_outside_the_verified_range_is_refused():
    with pytest.raises(PatchError, match="cuda_streams.*verified for megatron-core.*0.20.0 is installed"):
        BY_NAME["cuda_streams"].decide(Version("0.20.0"), cpu=True, have_te=False)
    with pytest.raises(PatchError, match="cuda_streams.*verified for megatron-core.*0.16.0 is installed"):
        BY_NAME["cuda_streams"].decide(Version("0.16.0"), cpu=True, have_te=False)


def test_patches_fixed_upstream_are_skipped():
    for version in ("0.17.0", "0.19.2"):
        decision = BY_NAME["te_general_gemm"].decide(Version(version), cpu=True, have_te=False)
        assert decision == "skipped: fixed upstream in megatron-core 0.17.0"


@pytest.mark.skipif(not fixed_upstream("te_general_gemm"), reason="megatron-core < 0.17 lacks the fix")
def test_upstream_defines_te_general_gemm_without_transformer_engine():
    from megatron.core.transformer.moe import moe_utils

    assert "te_general_gemm" in vars(moe_utils)  # the patch is not applied from 0.17 on: upstream's own


def test_gpu_nodes_get_no_cpu_patch_and_te_nodes_no_te_patch():
    version = Version("0.16.1")
    for patch in PATCHES:
        decision = patch.decide(version, cpu=False, have_te=True)
        expected = "apply" if patch.needed_when == "always" else "skipped"
        assert decision.startswith(expected), (patch.name, decision)
    assert BY_NAME["te_general_gemm"].decide(version, cpu=False, have_te=False) == "apply"


def test_anchor_check_fails_loudly_when_upstream_moves(monkeypatch):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    monkeypatch.delattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream")
    with pytest.raises(PatchError, match="cuda_streams.*upstream changed"):
        BY_NAME["cuda_streams"].check()


def test_unknown_patch_name_is_an_error():
    with pytest.raises(PatchError, match="unknown patch names"):
        from megatron_gspo import patches

        saved, patches._decisions = patches._decisions, None
        try:
            apply_patches(skip=("no_such_patch",))
        finally:
            patches._decisions = saved


@pytest.fixture(scope="module")
def single_process_runs():
    """The world-1 scenarios, started together (each needs a fresh process)."""
    names = ["-"] + [row[0] for row in STILL_NEEDED if row[1] == 1]
    running = {name: start_without(name) for name in names}
    return {name: finish(process) for name, process in running.items()}


@pytest.mark.slow  # the single-process scenario runs: ~45 s on a shared 2-core box
@needs_cpu
def test_control_the_scenario_runs_with_every_patch(single_process_runs):
    returncode, output = single_process_runs["-"]
    assert returncode == 0 and "RAN FINE" in output, output[-3000:]


# (patch, processes, TP, EP, failure message regex, upstream call site regex in the traceback).
# The same sites fail on megatron-core 0.16.1 and 0.19.2.
STILL_NEEDED = [
    ("cuda_device", 1, 1, 1, NO_CUDA, r"distributed/param_and_grad_buffer\.py\", line \d+, in __init__"),
    ("cuda_streams", 1, 1, 1, NO_CUDA, r"moe/token_dispatcher\.py\", line \d+, in __init__"),
    ("rng_tracker", 1, 1, 1, NO_CUDA, r"tensor_parallel/random\.py\", line \d+, in add"),
    (
        "te_general_gemm",
        1,
        1,
        1,
        r"NameError: name 'te_general_gemm' is not defined",
        r"moe/moe_utils\.py\", line \d+, in forward",
    ),
    ("cuda_tensors_to_cpu", 1, 1, 1, NO_CUDA, r"optimizer/optimizer\.py\", line \d+, in __init__"),
    (
        "schedule_token_counter",
        1,
        1,
        1,
        NO_CUDA,
        r"pipeline_parallel/schedules\.py\", line \d+, in forward_backward_no_pipelining",
    ),
    ("distributed_optimizer_step", 1, 1, 1, r"Adam step counters are shared between parameters", "scenario"),
    ("dist_checkpoint_results_queue", 1, 1, 1, r"left a Manager process running", "scenario"),
    (
        "distributed_optimizer_reshardable_load",
        1,
        1,
        1,
        r"KeyError: 'step'",
        r"optimizer/distrib_optimizer\.py\", line \d+, in _set_main_param_and_optimizer_states",
    ),
    (
        "torch_norm_sequence_parallel",
        2,
        2,
        1,
        r"sequence parallel not supported by torch LayerNorm",
        r"transformer/torch_norm\.py\", line \d+, in __new__",
    ),
    (
        "alltoall_split_sizes",
        2,
        1,
        2,
        r"TypeError: all_to_all_single\(\): incompatible function arguments",
        r"moe/token_dispatcher\.py\", line \d+, in token_dispatch",
    ),
    (
        "gloo_uneven_collectives",
        4,
        2,
        2,
        r"ProcessGroupGloo::allgather: invalid tensor size",
        r"tensor_parallel/mappings\.py\", line \d+, in _gather_along_first_dim",
    ),
]


@pytest.mark.slow  # the single-process scenario runs: ~45 s on a shared 2-core box
@needs_cpu
@pytest.mark.parametrize(
    "name,nproc,tp,ep,failure,site",
    [pytest.param(*row, id=row[0], marks=[pytest.mark.multiprocess] * (row[1] > 1)) for row in STILL_NEEDED],
)
def test_patch_is_still_needed(name, nproc, tp, ep, failure, site, single_process_runs):
    if nproc == 1:
        returncode, output = single_process_runs[name]
    else:
        returncode, output = finish(start_without(name, nproc, tp, ep))
    if fixed_upstream(name):
        assert returncode == 0 and "RAN FINE" in output, output[-3000:]
        return
    assert returncode != 0, f"{name}: scenario ran fine without the patch: upstream fixed it?"
    assert re.search(failure, output), output[-3000:]
    assert re.search(site, output), (site, output[-3000:])


@pytest.mark.multiprocess
@pytest.mark.slow  # two processes through the interleaved schedule: ~40 s on a shared 2-core box
def test_pipeline_shape_exchange_is_still_needed():
    """At PP2 the interleaved schedule's shape messages cross without the patch; with it, it runs."""
    returncode, output = finish(start_without("pipeline_shape_exchange", 2, 1, 1, "--vpp", "2"))
    assert returncode != 0, "pipeline_shape_exchange: scenario ran fine without the patch: upstream fixed it?"
    assert re.search(r"must match the size of tensor b|Received data size doesn't match", output), output[
        -3000:
    ]
    # a Python traceback ("line N, in"), or faulthandler's stack of a rank gloo aborted ("line N in")
    assert re.search(r"pipeline_parallel/p2p_communication\.py\", line \d+,? in _communicate", output), (
        output[-3000:]
    )
    returncode, output = finish(start_without("-", 2, 1, 1, "--vpp", "2"))
    assert returncode == 0 and "RAN FINE" in output, output[-3000:]


def test_every_patch_has_a_still_needed_test():
    still_needed = {row[0] for row in STILL_NEEDED} | {"pipeline_shape_exchange"}
    assert still_needed == {name for name, patch in BY_NAME.items() if not patch.speed_only}


def test_foreach_multi_tensor_ops_equal_megatrons_fallbacks():
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    from megatron_gspo.patches.cuda_tensors_to_cpu import CudaToCpuMode
    from megatron_gspo.patches.foreach_multi_tensor import foreach_l2_norm, foreach_scale

    generator = torch.Generator().manual_seed(0)
    shapes = [(7, 3), (5,), (2, 4, 6), (1,)]
    grads = [torch.randn(shape, generator=generator) * 10.0 ** (i - 2) for i, shape in enumerate(shapes)]
    flag = torch.zeros(1, dtype=torch.int)
    ours, _ = foreach_l2_norm(0, flag, [grads], False)
    norms = torch.tensor([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])
    assert ours.shape == (1,) and ours.dtype == torch.float32
    assert torch.allclose(ours.double(), torch.linalg.vector_norm(norms).reshape(1), rtol=1e-6)
    with CudaToCpuMode():  # megatron's own puts its result on device="cuda"
        upstream, _ = local_multi_tensor_l2_norm(0, flag, [grads], False)
    assert torch.allclose(ours, upstream, rtol=1e-6)

    for in_place in (True, False):  # clipping scales in place; param copies go list -> list
        expected = [g.clone() for g in grads]
        local_multi_tensor_scale(0, flag, [expected, expected] if in_place else [grads, expected], 0.37)
        got = [g.clone() for g in grads]
        foreach_scale(0, flag, [got, got] if in_place else [grads, got], 0.37)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    bf16 = [torch.empty(shape, dtype=torch.bfloat16) for shape in shapes]
    foreach_scale(0, flag, [grads, bf16], 1.0)  # fp32 main params -> bf16 model params
    assert all(torch.equal(b, g.bfloat16()) for b, g in zip(bf16, grads))


@needs_cpu
def test_foreach_multi_tensor_is_what_megatron_calls_without_apex_or_te():
    from megatron.core.optimizer import clip_grads, optimizer

    from megatron_gspo.patches.foreach_multi_tensor import foreach_l2_norm, foreach_scale

    apply_patches()
    assert clip_grads.l2_norm_impl is foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is foreach_scale
    assert optimizer.multi_tensor_scale_impl is foreach_scale


@pytest.fixture
def tiny_experts():
    """Layer 0's SequentialMLP (8 experts, H=64, F=32) of a freshly built tiny model."""
    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.config import tiny
    from megatron_gspo.model.distributed import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=3)
    model = build_model(tiny(vocab_size=32, init_std=0.2), ParallelConfig())
    return model.decoder.layers[0].mlp.experts


def _expert_pass(experts, forward, hidden, tokens_per_expert, probs, *, expanded_grad=False):
    """Output and the gradients of the input, the probabilities and every expert weight."""
    hidden, probs = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
    for param in experts.parameters():
        param.grad = None
    output, bias = forward(experts, hidden, tokens_per_expert, probs)
    if expanded_grad:  # sum's backward hands over a stride-0 gradient
        output.sum().backward()
    else:
        output.backward(torch.linspace(-1.0, 1.0, output.numel()).reshape(output.shape).to(output.dtype))
    return [output, hidden.grad, probs.grad, *(p.grad for p in experts.parameters())], bias


@pytest.mark.parametrize("expanded_grad", [False, True], ids=["grad", "expanded-grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_local_experts_equal_megatrons_loop_bit_for_bit(tiny_experts, dtype, expanded_grad):
    from megatron_gspo.patches import grouped_local_experts as grouped

    apply_patches()
    experts = tiny_experts.to(dtype)
    assert grouped.groupable(experts)
    generator = torch.Generator().manual_seed(1)
    counts = torch.tensor([5, 0, 17, 3, 0, 9, 1, 12])  # empty experts included
    hidden = torch.randn(int(counts.sum()), 64, generator=generator).to(dtype)
    probs = torch.rand(int(counts.sum()), generator=generator)
    ours, bias = _expert_pass(
        experts, grouped.grouped_forward, hidden, counts, probs, expanded_grad=expanded_grad
    )
    loop, loop_bias = _expert_pass(
        experts, grouped._ORIGINAL["forward"], hidden, counts, probs, expanded_grad=expanded_grad
    )
    assert bias is None and loop_bias is None
    assert len(ours) == 3 + 2 * 8
    for a, b in zip(ours, loop):
        assert a.dtype == b.dtype and torch.equal(a, b)


@needs_cpu
def test_grouped_local_experts_replace_the_loop_only_where_they_match_it(tiny_experts):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_gspo.patches import grouped_local_experts as grouped

    apply_patches()
    assert SequentialMLP.forward is grouped.patched_forward
    hidden = torch.randn(6, 64)
    assert grouped._aligned(tiny_experts, hidden)
    assert not grouped._aligned(tiny_experts, torch.randn(64, 6).T)  # the right width, not contiguous
    assert grouped.groupable(tiny_experts)
    tiny_experts.config.add_bias_linear = True  # a fresh model's config
    assert not grouped.groupable(tiny_experts)


@needs_cpu
def test_single_rank_all_reduce_skips_gloo_only_for_blocking_calls_outside_coalescing(monkeypatch):
    import torch.distributed as dist
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_gspo.model.distributed import ParallelConfig, init_distributed
    from megatron_gspo.patches import single_rank_all_reduce as single_rank

    init_distributed(ParallelConfig(), seed=0)  # a world of one, every patch applied
    assert dist.all_reduce.__single_rank__
    reached_gloo, upstream = [], dist.all_reduce.__wrapped__

    def gloo_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        reached_gloo.append(op)
        return upstream(tensor, op=op, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_reduce", single_rank._wrap(gloo_all_reduce))
    values = torch.tensor([1.5, -2.0, 7.25])
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        tensor = values.clone()
        assert dist.all_reduce(tensor, op=op) is None
        assert torch.equal(tensor, values)
    logits = torch.randn(3, 2, 11, generator=torch.Generator().manual_seed(0))
    target = torch.randint(0, 11, (3, 2))
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 11), target.view(-1), reduction="none")
    loss = vocab_parallel_cross_entropy(logits.clone(), target)  # megatron's three TP all-reduces
    assert torch.allclose(loss.view(-1), expected, atol=1e-6)
    assert reached_gloo == []

    tensor = values.clone()
    dist.all_reduce(tensor, async_op=True).wait()  # the caller waits on gloo's work
    assert len(reached_gloo) == 1
    for async_ops in (False, True):  # megatron DDP's grad reduction: a manager left with nothing to issue
        with dist.distributed_c10d._coalescing_manager(dist.group.WORLD, async_ops=async_ops) as manager:
            dist.all_reduce(tensor)
        manager.wait()
    assert torch.equal(tensor, values) and len(reached_gloo) == 1


@needs_cpu
def test_native_clip_grads_equal_megatrons_functions_under_the_mode():
    from megatron.core.optimizer import clip_grads, optimizer

    from megatron_gspo.model.distributed import ParallelConfig, init_distributed
    from megatron_gspo.patches import native_clip_grads as native

    init_distributed(ParallelConfig(), seed=0)  # a world of one (the norm's all-reduce), every patch applied
    for name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32"):
        assert getattr(clip_grads, name) is getattr(native, name)  # what megatron's optimizer calls
        assert getattr(optimizer, name) is getattr(native, name)
    upstream_norm = native._FALLBACK["get_grad_norm_fp32"]
    upstream_clip = native._FALLBACK["clip_grad_by_total_norm_fp32"]

    generator = torch.Generator().manual_seed(0)
    shapes = [(7, 3), (5,), (2, 4, 6), (1,), (64, 32)]
    grads = [torch.randn(shape, generator=generator) * 10.0 ** (i - 2) for i, shape in enumerate(shapes)]
    norm = native.get_grad_norm_fp32(grads)
    assert isinstance(norm, float) and norm == upstream_norm(grads)
    reference = torch.linalg.vector_norm(torch.cat([g.flatten().double() for g in grads]))
    assert abs(norm - float(reference)) <= 1e-6 * norm
    assert native.get_grad_norm_fp32(grads, norm_type=float("inf")) == upstream_norm(grads, float("inf"))

    for max_norm in (0.5 * norm, 2.0 * norm):  # clipped, and left alone (coefficient >= 1)
        ours = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads]
        theirs = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads]
        for a, b, g in zip(ours, theirs, grads):
            a.grad, b.grad = g.clone(), g.clone()
        ours[1].grad = theirs[1].grad = None  # parameters without a gradient are skipped
        native.clip_grad_by_total_norm_fp32(ours, max_norm, norm)
        upstream_clip(theirs, max_norm, norm)
        assert all(a.grad is None or torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs))
    assert not torch.equal(ours[0].grad, grads[0]) or max_norm >= norm

    half = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    half.grad = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(AssertionError):  # megatron's own refusal of a non-fp32 grad, kept
        native.clip_grad_by_total_norm_fp32([half], 0.1, 10.0)


def test_a_transformer_engine_that_fails_to_import_is_not_available(tmp_path):
    """An installed TE whose library does not load (wrong CUDA build) counts as absent, with a warning."""
    broken = tmp_path / "transformer_engine"
    (broken / "pytorch").mkdir(parents=True)
    (broken / "__init__.py").write_text("")
    (broken / "pytorch" / "__init__.py").write_text(
        "raise OSError('libcudart.so.12: cannot open shared object file: No such file or directory')\n"
    )
    probe = (
        "import logging; logging.basicConfig();"
        "from megatron_gspo.patches import transformer_engine_available as te;"
        "print('available', te())"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "available False" in done.stdout
    assert "transformer_engine is installed but does not import (OSError: libcudart.so.12" in done.stderr
