"""Bodies of the GPU smoke checks, written against the device and engine they are given.

The tests in this directory call them on a CUDA device with bf16 (and the TransformerEngine
spec when TE imports); the model checks also run on CPU in fp32 and bf16 with the local spec,
which is how their logic is exercised on a machine without a GPU. Every function works in the current
process's world of one (`init_distributed(ParallelConfig())`) unless it starts its own
processes (`run_rl_steps`, `run_parity`).

Tolerances for bf16 (unit roundoff u = 2^-8 ~ 3.9e-3). The same weights and tokens go through
different kernels (a THD row of all samples vs [1, n] rows: other GEMM shapes, another expert
token order and attention tiling), each rounding its outputs to bf16 in its own order, and an
MoE router can flip an expert choice on such a perturbation, so single tokens move most. The
models use init std 0.05 (log-probs ~ -5 nats, sharp enough for a leak to show). Measured with
megatron's local spec computing in bf16 on CPU (the tiny and the 4-layer model, both layouts):

- packed vs one-sample-per-row: worst token <= 0.055 nats, mean <= 0.0061; samples that see
  their row neighbours (what TE's causal kernel does with the mask it ignores) differ by a
  mean of 0.21 (tiny) to 0.76 (4-layer) nats. `PACKED_BF16_TOL` = (0.25, 0.02).
- Megatron in bf16 vs transformers in fp32 on the same bf16-representable weights (tiny):
  worst 0.066, mean 0.0028; the fc1 gate/up halves swapped give mean 0.031, the input
  RMSNorm weights + 1 (a zero-centred-gamma mix-up) 0.11. `HF_BF16_TOL` = (0.3, 0.015).
- the RL run's first trained step trainer (bf16) vs embedded server (fp32) mismatch, same weights: the
  cold-started policy is sharper than these models, so the HF bound's mean gets a 3x margin:
  `RL_BF16_MISMATCH_TOL` = 0.05 mean nats per response token (a packing leak is O(0.2-1)).

fp32 tolerances are those of the CPU suite's own checks (their errors are ~1e-6).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
PACKED_FP32_TOL = (1e-4, 1e-5)
PACKED_BF16_TOL = (0.25, 0.02)
HF_FP32_TOL = (1e-4, 1e-5)
HF_BF16_TOL = (0.3, 0.015)
RL_BF16_MISMATCH_TOL = 0.05
INIT_STD = 0.05
"""Init std of the models compared against a reference (see the tolerances above)."""
MEMORY_BAND = (0.85, 1.06)
"""Measured peak / plan estimate must lie in this band: the margin `plan`'s layouts rely on.

Above: the 235B-A22B layout fits at 68.8 GiB per stage (model states + activation) plus the 6 GiB
reserve (CUDA context, NCCL buffers, fragmentation: none of them in torch's allocated bytes) =
74.8 of the 79.1 GiB torch gets of an H100, so 4.3 GiB (6% of 68.8) is all that absorbs a peak
above the estimate; a plan low by more would pass a layout that runs out of memory. Below: model
states are exact byte counts, so a peak 15% under the estimate means the activation model counts
tensors that are not there, and `plan` would refuse layouts that fit (the 235B without PP is
refused by 3%).
"""


def te_import_error() -> str | None:
    """Why TransformerEngine's PyTorch API does not import here, or None when it does."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a missing package or a broken CUDA extension
        return f"{type(err).__name__}: {err}".splitlines()[0][:200]
    return None


def tolerances(engine) -> tuple[tuple[float, float], tuple[float, float]]:
    """(packed vs per-row, Megatron vs HF) as (max, mean) |log-prob difference| for `engine`."""
    if engine.dtype == "bf16":
        return PACKED_BF16_TOL, HF_BF16_TOL
    return PACKED_FP32_TOL, HF_FP32_TOL


def world_of_one():
    """Start (or reuse) this process's world of one; returns the default group's backend."""
    import torch.distributed as dist

    from megatron_gspo.model.distributed import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=1234)
    return dist.get_backend()


def check_world_of_one() -> str:
    """NCCL (CUDA) / gloo (CPU) default group of one, the gloo control group, a collective on the device.

    Returns:
        A one-line figure for the verdict.
    """
    import torch.distributed as dist

    from megatron_gspo.model import control_plane
    from megatron_gspo.model.distributed import compute_device

    backend = world_of_one()
    device = compute_device()
    want = "nccl" if device.type == "cuda" else "gloo"
    assert backend == want, f"default process group is {backend}, expected {want} on {device}"
    assert dist.get_world_size() == 1
    control = dist.get_backend(control_plane.control_group())
    assert control == "gloo", f"control group is {control}, expected gloo"
    value = torch.arange(4, dtype=torch.float32, device=device)
    dist.all_reduce(value)
    assert value.device == device and value.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert control_plane.on_rank0(lambda: "ok") == "ok"
    return f"default group {backend} on {device}, control group {control}, all_reduce ok"


def tiny_model(**changes):
    """The tiny policy (2 layers, 8 experts top-2; vocab 96 covers the char tokenizer)."""
    from megatron_gspo.model.config import tiny

    return tiny(vocab_size=96, **changes)


def four_layer_model(**changes):
    """A 4-layer, 16-expert top-4 model, wider than the tiny one (GEMM shapes TE's kernels tile)."""
    from megatron_gspo.model.config import tiny

    base = dict(
        vocab_size=512,
        hidden_size=256,
        num_layers=4,
        num_attention_heads=8,
        num_query_groups=4,
        head_dim=32,
        num_experts=16,
        moe_topk=4,
        moe_ffn_hidden_size=128,
    )
    return tiny(**{**base, **changes})


def random_samples(vocab_size: int, lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Samples of the given lengths, uniform token ids (CPU; the packer moves them)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]


def build(model_cfg, engine):
    """`build_model` in the world of one."""
    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.distributed import ParallelConfig

    world_of_one()
    return build_model(model_cfg, ParallelConfig(), engine)


def check_build(model_cfg, engine, *, expect_te: bool) -> str:
    """Build `model_cfg` with `engine`, check spec/dtype/device, run one forward + backward.

    Checks: every parameter on the compute device; the weight matrices in the engine's dtype;
    under TE the TE spec with grouped-GEMM experts, TE parameter names and the THD layout;
    without TE the local spec and the mask layout; finite log-probs <= 0 and finite, non-zero
    gradients (through megatron's DDP, as in training: fused grad accumulation needs it).
    """
    from megatron_gspo.model.distributed import compute_device
    from megatron_gspo.model.logprobs import sequence_logprobs
    from megatron_gspo.model.optim import wrap_ddp
    from megatron_gspo.model.packing import packing_layout

    model = build(model_cfg, engine)
    device = compute_device()
    params = dict(model.named_parameters())
    off_device = [n for n, p in params.items() if p.device != device]
    assert not off_device, f"{len(off_device)} parameters not on {device}, e.g. {off_device[:3]}"
    matrices = {n: p.dtype for n, p in params.items() if p.dim() >= 2 and ".router." not in n}
    wrong = {n: d for n, d in matrices.items() if d != engine.torch_dtype}
    assert not wrong, f"weights not in {engine.torch_dtype}: {dict(list(wrong.items())[:3])}"
    layout = packing_layout(model)
    gpt = getattr(model, "module", model)  # bf16: megatron's Float16Module around the GPTModel
    experts = type(gpt.decoder.layers[0].mlp.experts).__name__
    if expect_te:
        assert model.config.moe_grouped_gemm, "the TE engine did not turn on grouped GEMM"
        assert experts == "TEGroupedMLP", f"experts are {experts}, expected TEGroupedMLP"
        assert any(n.endswith("linear_qkv.layer_norm_weight") for n in params), "no TE fused-norm names"
        assert any(n.endswith("experts.linear_fc1.weight0") for n in params), "no grouped-GEMM names"
        assert layout == "thd", f"TE model packs with {layout!r}, expected 'thd'"
    else:
        assert not model.config.moe_grouped_gemm
        assert layout == "mask", f"local-spec model packs with {layout!r}, expected 'mask'"
    ddp = wrap_ddp(model)
    ddp.zero_grad_buffer()
    samples = random_samples(model_cfg.vocab_size, [17, 40, 9, 64, 33])
    logprobs, entropy = sequence_logprobs(ddp, samples, with_entropy=True)
    assert logprobs.device == device and logprobs.dtype == torch.float32
    assert torch.isfinite(logprobs).all() and (logprobs <= 0).all()
    assert torch.isfinite(entropy).all()
    (-logprobs.sum() / sum(len(s) - 1 for s in samples)).backward()
    grads = [p.main_grad for p in ddp.parameters() if getattr(p, "main_grad", None) is not None]
    assert grads, "no gradient buffers"
    assert all(torch.isfinite(g).all() for g in grads), "non-finite gradients"
    norm = torch.sqrt(sum(g.float().pow(2).sum() for g in grads)).item()
    assert norm > 0, "all gradients are zero"
    n_params = sum(p.numel() for p in params.values())
    return f"{n_params} params, {experts}, layout {layout}, {engine.dtype} on {device}, grad norm {norm:.3g}"


def check_selective_recompute_grads(model_cfg, engine) -> str:
    """The GPU configs' selective recompute (TE: moe_act, layernorm) gives the gradients of none.

    TE's fused-attention backward may accumulate in another order run to run, so the bound is twice
    what two runs without recompute differ by (plus 1e-6 of the largest gradient).
    """
    import dataclasses

    from megatron_gspo.model.logprobs import sequence_logprobs
    from megatron_gspo.model.optim import wrap_ddp

    world_of_one()
    weights = None
    samples = random_samples(model_cfg.vocab_size, [17, 40, 9, 64, 33])

    def grads(recompute: dict) -> torch.Tensor:
        nonlocal weights
        model = build(model_cfg, dataclasses.replace(engine, **recompute))
        if weights is None:
            weights = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        model.load_state_dict(weights, strict=False)
        ddp = wrap_ddp(model)
        ddp.zero_grad_buffer()
        sequence_logprobs(ddp, samples)[0].sum().backward()
        return torch.cat([p.main_grad.flatten().float() for p in ddp.parameters() if p.requires_grad])

    plain, again = grads({}), grads({})
    selective = grads(dict(recompute_granularity="selective", recompute_modules=["moe_act", "layernorm"]))
    scale = plain.abs().max().item()
    noise = (again - plain).abs().max().item()
    diff = (selective - plain).abs().max().item()
    assert scale > 0 and diff <= 2 * noise + 1e-6 * scale, (diff, noise, scale)
    return (
        f"selective [moe_act, layernorm] vs none: max|d grad| {diff:.3g} "
        f"(run-to-run {noise:.3g}, max {scale:.3g})"
    )


def per_row_logprobs(model, samples: list[torch.Tensor], *, te: bool) -> torch.Tensor:
    """Reference: each sample alone in a [1, n] row, the model's own causal attention, [B, T] fp32.

    No packing code: tokens and positions 0..n-1 go straight into GPTModel; TE's attention is
    causal by its mask type, the local one gets the plain [1, 1, n, n] causal mask. Log-probs
    are log_softmax of the returned logits in fp32, gathered at the next token.
    """
    from megatron_gspo.model.distributed import compute_device

    device = compute_device()
    out = torch.zeros(len(samples), max(len(s) for s in samples), dtype=torch.float32, device=device)
    for b, sample in enumerate(samples):
        n = len(sample)
        tokens = sample.to(device).view(1, n)
        positions = torch.arange(n, device=device).view(1, n)
        mask = None if te else torch.ones(n, n, dtype=torch.bool, device=device).triu(1).view(1, 1, n, n)
        logits = model(tokens, positions, attention_mask=mask)  # [1, n, V]
        picked = torch.log_softmax(logits.float()[0, :-1], dim=-1).gather(-1, tokens[0, 1:, None])
        out[b, 1:n] = picked.squeeze(-1)
    return out


@torch.no_grad()
def check_packed_equals_per_row(model_cfg, engine, *, layout: str, te: bool) -> str:
    """Packed log-probs (`layout`) == one sample per row, within the engine's tolerance.

    Init std `INIT_STD`, so a sample attending to its row neighbours shows. Lengths are odd
    and uneven so the THD layout pads every sequence (pad_multiple 2 here, as under TP2).
    Under TE a "mask" batch must be refused (its causal kernel ignores the mask).
    """
    from megatron_gspo.model.logprobs import packed_forward, sequence_logprobs
    from megatron_gspo.model.packing import PackingError, pack_sequences

    model = build(model_cfg.replace(init_std=INIT_STD), engine).eval()
    samples = random_samples(model_cfg.vocab_size, [23, 5, 61, 2, 37, 14, 48, 9], seed=1)
    packed, _ = sequence_logprobs(model, samples, layout=layout, pad_multiple=2)
    reference = per_row_logprobs(model, samples, te=te)
    mask = torch.zeros_like(reference, dtype=torch.bool)
    for b, s in enumerate(samples):
        mask[b, 1 : len(s)] = True
    diff = (packed - reference).abs()[mask]
    (tol_max, tol_mean), _ = tolerances(engine)
    if te:
        try:
            packed_forward(model, pack_sequences(samples, layout="mask"))
        except PackingError:
            pass
        else:
            raise AssertionError("a 'mask' packed batch was accepted by a TE model")
    worst, mean = diff.max().item(), diff.mean().item()
    figure = f"{layout}: max|d logprob| {worst:.2e} (tol {tol_max:g}), mean {mean:.2e} (tol {tol_mean:g})"
    assert worst <= tol_max and mean <= tol_mean, figure
    return figure


def check_hf_roundtrip(tmp_path: Path, model_cfg, engine, *, te: bool) -> str:
    """HF checkpoint -> Megatron (`engine`) -> HF: names and values exact, log-probs match HF's.

    The HF checkpoint is written in fp32 and imported into an `engine.dtype` model; what comes
    back must be exactly the HF tensors cast to that dtype, under the same HF names. Then the
    exported checkpoint is loaded by transformers (fp32, CPU) and its per-token log-probs are
    compared with Megatron's. With `te`, the model's own parameter names are TE's.
    """
    from transformers import AutoModelForCausalLM

    from megatron_gspo.model.distributed import compute_device
    from megatron_gspo.model.hf.checkpoint import load_hf_state_dict, make_tiny_hf_checkpoint
    from megatron_gspo.model.hf.convert import (
        hf_to_megatron,
        hf_token_logprobs,
        load_hf_checkpoint,
        logprob_diff,
        random_tokens,
    )
    from megatron_gspo.model.hf.export import export_hf_checkpoint
    from megatron_gspo.model.sharding import gather_global_state_dict

    cfg = model_cfg.replace(init_std=INIT_STD)
    hf_dir = make_tiny_hf_checkpoint(tmp_path / "hf", cfg, seed=3)
    model = build(cfg, engine).eval()
    names = [n for n, _ in model.named_parameters()]
    if te:
        assert any(n.endswith("linear_qkv.layer_norm_weight") for n in names), "model has no TE names"
        assert any(n.endswith("experts.linear_fc1.weight0") for n in names), "model has no grouped-GEMM names"
    stats = load_hf_checkpoint(model, hf_dir, cfg)
    original = {k: v.to(engine.torch_dtype) for k, v in load_hf_state_dict(hf_dir).items()}
    want = hf_to_megatron(original, cfg)
    got = gather_global_state_dict(model)
    assert sorted(got) == sorted(want), f"imported names differ: {sorted(set(got) ^ set(want))[:5]}"
    differ = [k for k in want if not torch.equal(got[k].cpu().to(engine.torch_dtype), want[k])]
    assert not differ, f"{len(differ)} tensors differ after import, e.g. {differ[:3]}"
    out = export_hf_checkpoint(model, tmp_path / "exported", cfg)
    exported = load_hf_state_dict(out)
    renamed = sorted(set(exported) ^ set(original))
    assert not renamed, f"exported names differ: {renamed[:5]}"
    differ = [k for k in original if not torch.equal(exported[k].to(engine.torch_dtype), original[k])]
    assert not differ, f"{len(differ)} tensors differ after export, e.g. {differ[:3]}"
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = random_tokens(cfg.vocab_size, batch=4, length=48, seed=5)
    device = compute_device()
    worst, mean = logprob_diff(model, lambda t: hf_token_logprobs(hf_model, t).to(device), tokens)
    _, (tol_max, tol_mean) = tolerances(engine)
    figure = (
        f"{stats.tensors} tensors in, {len(exported)} HF tensors out, exact; "
        f"log-probs vs transformers fp32: max {worst:.2e} (tol {tol_max:g}), "
        f"mean {mean:.2e} (tol {tol_mean:g})"
    )
    assert worst <= tol_max and mean <= tol_mean, figure
    return figure


def memory_model(**changes):
    """A model whose peak memory is GiBs, so model states and activations dominate the workspaces."""
    from megatron_gspo.model.config import MoEModelConfig

    base = dict(
        vocab_size=32768,
        hidden_size=1024,
        num_layers=4,
        num_attention_heads=8,
        num_query_groups=4,
        head_dim=128,
        num_experts=16,
        moe_topk=4,
        moe_ffn_hidden_size=512,
        max_position_embeddings=1024,
    )
    return MoEModelConfig(**{**base, **changes})


@dataclass
class MemoryEstimate:
    """`megatron-gspo plan`'s per-rank estimate, without its reserve (not tensor allocations)."""

    model_states: int
    activation: int

    @property
    def total(self) -> int:
        """Bytes the caching allocator should hold at the peak."""
        return self.model_states + self.activation


def plan_estimate(model_cfg, engine, *, samples: int, seq_len: int, flash_attention: bool) -> MemoryEstimate:
    """The plan's model-state and activation bytes for one rank training `samples` x `seq_len`."""
    from megatron_gspo.model.distributed import ParallelConfig
    from megatron_gspo.plan import activation_plan, shard_plan

    parallel = ParallelConfig()
    states = shard_plan(model_cfg, parallel, engine, world_size=1)
    tokens = samples * seq_len
    act = activation_plan(
        model_cfg, parallel, engine, tokens=tokens, seq_len=seq_len, flash_attention=flash_attention
    )
    return MemoryEstimate(states.total_bytes, act.total_bytes)


def memory_verdict(measured: int, estimate: MemoryEstimate) -> str:
    """Figure of measured peak bytes vs the estimate; raises when outside `MEMORY_BAND`."""
    gib, ratio = 2**30, measured / estimate.total
    low, high = MEMORY_BAND
    figure = (
        f"peak {measured / gib:.2f} GiB vs plan {estimate.total / gib:.2f} GiB (model states "
        f"{estimate.model_states / gib:.2f} + activation {estimate.activation / gib:.2f}) = {ratio:.2f}x "
        f"(allowed {low:g}x-{high:g}x)"
    )
    assert low <= ratio <= high, figure
    return figure


def memory_workload(model_cfg, engine, *, samples: int, seq_len: int, iterations: int = 2) -> float:
    """Train `iterations` Adam steps on `samples` x `seq_len` tokens as the trainer does; returns the loss.

    Two iterations: Adam's states exist from the first step on, so the second forward/backward
    holds model states and activations together (the plan's peak).
    """
    from megatron_gspo.model.logprobs import sequence_logprobs
    from megatron_gspo.model.optim import OptimConfig, build_optimizer, optimizer_step, wrap_ddp, zero_grads

    model = build(model_cfg, engine)
    ddp = wrap_ddp(model)
    optimizer, scheduler = build_optimizer(ddp, OptimConfig(lr=1e-5))
    batch = random_samples(model_cfg.vocab_size, [seq_len] * samples, seed=2)
    loss = math.nan
    for _ in range(iterations):
        zero_grads(ddp, optimizer)
        logprobs, _ = sequence_logprobs(ddp, batch)
        objective = -logprobs.sum() / (samples * (seq_len - 1))
        objective.backward()
        stepped, _ = optimizer_step(ddp, optimizer, scheduler)
        assert stepped, "optimizer step skipped (non-finite gradients)"
        loss = objective.item()
    return loss


def run_rl_steps(run_dir: Path, *overrides: str, steps: int = 5, timeout: float = 1800) -> list[dict]:
    """`megatron-gspo train` on the tiny config for `steps` RL steps with the embedded server.

    The trainer runs on this machine's compute device (CUDA device 0 when there is one); the
    embedded rollout server it starts runs transformers on the host CPU. Returns the
    metrics records; raises with the output's tail when the run fails.
    """
    from megatron_gspo.training.metrics import read_metrics

    cmd = [
        sys.executable,
        "-m",
        "megatron_gspo.cli",
        "train",
        "--config",
        str(REPO / "configs" / "tiny_moe_cpu.yaml"),
        f"trainer.steps={steps}",
        "trainer.save_every=0",
        "sft.steps=30",
        "task.options.format_reward=0.5",
        "rollout.temperature=1.0",
        "eval.num_problems=20",
        "rollout.rollout_batch_size=16",
        "rollout.group_size=4",
        "algorithm.num_mini_batches=2",
        "logging.progress_bar=false",
        "logging.tensorboard=false",  # the core install: no tensorboard (pyproject extras)
        f"trainer.run_dir={run_dir}",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"train exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
    return read_metrics(Path(run_dir) / "metrics.jsonl")


def check_rl_records(records: list[dict], steps: int, *, mismatch_tol: float, min_trained: int = 3) -> str:
    """Every step logged and synced, at least `min_trained` of them trained, numbers finite.

    A step whose groups all got equal rewards has nothing to learn and trains nothing
    (`train/all_zero_adv_batch`); the others must take every optimizer step. `mismatch_tol`
    bounds the mean |trainer - rollout| log-prob of the first trained step, whose rollouts
    came from the weights the trainer starts from: only numerics differ (module docstring).
    """
    assert [r["step"] for r in records] == list(range(steps + 1)), [r["step"] for r in records]
    trained = []
    for r in records[1:]:
        assert r["weight_version"] == r["step"], f"step {r['step']}: weight_version {r['weight_version']}"
        bad = [k for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)]
        assert not bad, f"step {r['step']}: non-finite {bad}"
        if r.get("train/all_zero_adv_batch") == 1.0:
            continue
        assert r["train/skipped_steps"] == 0, f"step {r['step']} skipped an optimizer step"
        trained.append(r)
    assert len(trained) >= min_trained, f"only {len(trained)} of {steps} steps trained (all-zero advantages)"
    first = trained[0]
    mean, worst = first["rollout/logprob_mismatch_mean"], first["rollout/logprob_mismatch_max"]
    figure = (
        f"{steps} steps ({len(trained)} trained); step-{first['step']} trainer/rollout log-prob mismatch "
        f"mean {mean:.2e} (tol {mismatch_tol:g}) max {worst:.2e}; "
        f"reward {records[1]['rollout/reward_mean']:.3f} -> {records[-1]['rollout/reward_mean']:.3f}"
    )
    assert mean <= mismatch_tol, figure
    return figure


def run_parity(tp: int, ep: int, nproc: int, *, timeout: float = 900) -> str:
    """`megatron-gspo parity --tp tp --ep ep` under torchrun with `nproc` workers; returns its result line."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "megatron_gspo.cli",
        "parity",
        "--tp",
        str(tp),
        "--ep",
        str(ep),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("parity ")]
    if done.returncode != 0 or not lines:
        raise AssertionError(f"parity exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
    return f"{lines[-1]} ({time.monotonic() - start:.0f} s)"
