"""`megatron-gspo parity`: trust a parallel layout by comparing it with TP=EP=1.

In one world of N ranks, first every rank builds the tiny policy at TP=1, EP=1 (a pure
data-parallel replica fed the whole batch), records per-token log-probs and the weights
after one optimizer step on a fixed batch; then megatron's groups are rebuilt for the requested
TP x EP x PP layout, the same global weights are loaded, the batch is split over
data-parallel ranks with a globally normalised loss, and the same step is taken. Both runs
go through megatron's forward-backward schedule in micro-batches (1F1B under PP), as
training does; `--recompute` turns on full activation recompute in both. Rank 0 prints the max
absolute differences; the exit status is non-zero above the tolerance.

In fp32 the Adam step is made linear in the gradient: with eps far above every gradient (and lr
= eps) Adam's first step lr x g / (|g| + eps) is g to 1e-6, so the step compares the gradients,
relative to the largest one, through the same optimizer (and distributed optimizer) training
uses. With its usual eps Adam's first step moves each weight by ~lr x sign(grad) whatever the
gradient's size: a gradient of ~0 whose last bits differ under another reduction order flips
its weight by 2 lr on a healthy layout (seen on users' checkpoints: max|d weight| 2e-3 = 2 lr).

With `--dtype bf16` both runs train in megatron's bf16 mixed precision. The layout then
rounds its partial sums to bf16 in another order than TP=1, so it differs from TP=1 by about
what bf16 rounding itself changes: each forward of a bf16 model is one rounding path. The
check therefore also measures that rounding effect, the same weights run in fp32 at TP=1,
and bounds the layout's mean / max |d log-prob| by `BF16_FACTOR` times it (measured: TP2's
mean is 0.6x-1x of it; the sharding bugs injected in tests/model/test_parity_cli.py, a wrong
expert mapping and one expert's TP slices exchanged, give 8.5x and 3.8x).
The first Adam step moves every weight by about lr * sign(grad); bf16 rounding flips the
sign of near-zero gradients and the rounding of some weights, so the max |d weight| is
~2 lr for noise and bug alike: the mean (noise ~lr / 70) is bounded instead, with the
relative grad-norm difference. The bf16 model uses init std `BF16_INIT_STD`, sharp enough
(log-probs ~ -4.6 nats) for a bug to stand out of the rounding noise.

With `--hf-path CKPT` the model is the user's own checkpoint (an HF directory, a training
checkpoint or a run directory, `checkpoint/source.py`): its architecture and weights
replace the tiny random policy, so a layout is checked on the model it will train.

Like with like: both runs take the same micro-batches (`_plan`: the same samples, packed with
the layout's pad multiple; a rank with none left runs a zero-weight filler) and vocabulary
padding (the reference pads the vocabulary to the layout's multiple, as training at that TP
does). The MoE load-balancing loss is not linear and counted per micro-batch, so both weight
each micro-batch's aux loss by its share of the loss normaliser, as RL does
(`model/aux_loss.py`); its coefficient is the checkpoint's `router_aux_loss_coef` unless
`--aux-loss-coeff` says otherwise (RL's `algorithm.aux_loss_coeff` is 0 by default), and the
line says which.

On a CPU machine without an outer torchrun, the command re-launches itself under torchrun
with gloo workers; on GPU nodes run it under torchrun directly.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

import torch

DEFAULT_TOLERANCE = 1e-5
MICRO_BATCH_SIZE = 2
"""Samples per micro-batch: several micro-batches per rank, so a pipeline has some in flight."""
LR = 1e-3
LINEAR_ADAM_EPS = 1e6
"""fp32: Adam's eps (and lr): the first step is g / (1 + |g| / eps), the gradient to 1e-6 (clipped
gradients are at most 1), and large enough against the weights that updated - initial resolves
it to fp32 precision (at lr 1e-3 the step is ~1e-5 of the weights, their rounding 1e-4 of it)."""
BF16_INIT_STD = 0.05
BF16_FACTOR = 2.0
"""bf16: layout vs TP=1 |d log-prob| (mean and max) <= this x the bf16-vs-fp32 distance at TP=1."""
BF16_WEIGHT_MEAN = LR / 20
"""bf16: mean |d weight| after the Adam step (measured noise ~LR / 70)."""
BF16_GRAD_NORM_REL = 2 * 2**-8
"""bf16: relative grad-norm difference, two units of bf16 roundoff (measured noise <= 3e-4)."""


def add_parity_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megatron-gspo parity`."""
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size to check")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size to check")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to check")
    parser.add_argument("--vpp", type=int, help="model chunks per pipeline stage (virtual pipeline)")
    parser.add_argument("--first-stage-layers", type=int, help="layers of the first stage (uneven pipeline)")
    parser.add_argument("--last-stage-layers", type=int, help="layers of the last stage (uneven pipeline)")
    parser.add_argument(
        "--num-layers", type=int, default=2, help="layers of the tiny random model (enough for the stages)"
    )
    parser.add_argument("--recompute", action="store_true", help="full activation recompute in both runs")
    parser.add_argument("--dispatcher", choices=["alltoall", "allgather"], default="alltoall")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--dtype", choices=["fp32", "bf16"], default="fp32", help="engine.dtype of both runs (see module doc)"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help=f"fp32: bound on every max difference (default {DEFAULT_TOLERANCE:g}); bf16 has its own bounds",
    )
    parser.add_argument("--distributed-optimizer", action="store_true", help="shard Adam states over DP")
    parser.add_argument(
        "--aux-loss-coeff",
        type=float,
        help="MoE load-balancing loss coefficient of both runs (default: the model's router_aux_loss_coef)",
    )
    parser.add_argument(
        "--hf-path",
        help="check on this checkpoint (HF dir, training checkpoint or run dir), not the tiny random model",
    )


def required_world_size(tp: int, ep: int, pp: int = 1) -> int:
    """Smallest world that holds the layout (expert-TP defaults to TP)."""
    return math.lcm(tp * pp, tp * ep * pp)


def run_parity(args: argparse.Namespace) -> int:
    """Entry point: re-launch under torchrun on CPU if needed, else run the check."""
    if args.dtype == "bf16" and args.tolerance is not None:
        print(
            "--tolerance applies to --dtype fp32; bf16 is bounded relative to bf16 rounding", file=sys.stderr
        )
        return 2
    if args.hf_path:
        _check_layout_fits(_checkpoint_model(args)[1], args)
    else:
        _check_tiny_layout(args)
    world = required_world_size(args.tp, args.ep, args.pp)
    if "RANK" not in os.environ and world > 1:
        if torch.cuda.is_available():
            print(f"run under torchrun with {world} (or a multiple of {world}) GPUs", file=sys.stderr)
            return 2
        from megatron_gspo.training.launch import relaunch

        return relaunch(world)
    return _check(args)


def _layout(args: argparse.Namespace):
    """The `ParallelConfig` under check."""
    from megatron_gspo.model.distributed import ParallelConfig

    return ParallelConfig(
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        virtual_pipeline=args.vpp,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
        expert_parallel=args.ep,
        token_dispatcher=args.dispatcher,
        distributed_optimizer=args.distributed_optimizer,
    )


def _checkpoint_model(args: argparse.Namespace):
    """(resolved checkpoint, its architecture) of `--hf-path`."""
    from megatron_gspo.checkpoint.meta import MODEL_DIR
    from megatron_gspo.checkpoint.source import resolve_checkpoint
    from megatron_gspo.model.hf.convert import read_hf_config

    source = resolve_checkpoint(args.hf_path, "--hf-path")
    return source, read_hf_config(source.path if source.kind == "hf" else source.path / MODEL_DIR)


def _check_layout_fits(model_cfg, args: argparse.Namespace) -> None:
    """The layout divides what it splits; else a `ConfigError` naming the flag."""
    from megatron_gspo.config import ConfigError

    splits = [
        ("--tp", args.tp, "attention heads", model_cfg.num_attention_heads),
        ("--tp", args.tp, "key/value heads", model_cfg.num_query_groups),
        ("--ep", args.ep, "experts", model_cfg.num_experts),
    ]
    for flag, size, what, count in splits:
        if size < 1 or count % size:
            raise ConfigError(f"{flag} {size} does not divide the {count} {what} of --hf-path {args.hf_path}")
    try:
        _layout(args).chunk_layers(model_cfg.num_layers)
    except ValueError as err:
        raise ConfigError(
            f"--pp / --vpp / --first-stage-layers / --last-stage-layers on --hf-path {args.hf_path}: {err}"
        ) from None


def _check_tiny_layout(args: argparse.Namespace) -> None:
    """The pipeline splits the tiny model's `--num-layers`; else a `ConfigError` naming the flags."""
    from megatron_gspo.config import ConfigError

    try:
        _layout(args).chunk_layers(args.num_layers)
    except ValueError as err:
        raise ConfigError(
            f"--pp / --vpp / --first-stage-layers / --last-stage-layers with --num-layers "
            f"{args.num_layers}: {err}"
        ) from None


def _load_checkpoint(model, source, model_cfg) -> None:
    """The checkpoint's weights into this rank's shard (HF: per-shard reads; training: dist ckpt)."""
    from megatron_gspo.checkpoint.load import load_weights
    from megatron_gspo.model.hf.convert import load_hf_checkpoint

    if source.kind == "hf":
        load_hf_checkpoint(model, source.path, model_cfg)
    else:
        load_weights(source.path, model)


def _batch(vocab_size: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Eight samples of varied length; the second half of each is the 'response'."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 40, (8,), generator=gen).tolist()
    seqs = [torch.randint(3, vocab_size, (n,), generator=gen) for n in lengths]
    masks = [torch.arange(n) >= n // 2 for n in lengths]
    return seqs, masks


def _plan(num_samples: int) -> list[list[int]]:
    """The micro-batches of both runs: `MICRO_BATCH_SIZE` consecutive samples each.

    Data-parallel rank r of a run takes `plan[r::dp]`, so both runs hold the same micro-batches
    whatever their DP sizes (the aux loss of a micro-batch depends on what it holds).
    """
    return [
        list(range(i, min(i + MICRO_BATCH_SIZE, num_samples)))
        for i in range(0, num_samples, MICRO_BATCH_SIZE)
    ]


def _packed(seqs: list[torch.Tensor], chunks: list[list[int]], pad_multiple: int):
    """`chunks` of `seqs` as packed micro-batches (shapes uniform over EP)."""
    from megatron_gspo.model.packing import pack_sequences, pad_to_shape, uniform_shape

    out = []
    for chunk in chunks:
        packed = pack_sequences([seqs[i] for i in chunk], pad_multiple=pad_multiple)
        out.append((chunk, pad_to_shape(packed, *uniform_shape(packed))))
    return out


def _schedule_logprobs(ddp, seqs: list[torch.Tensor], pad_multiple: int) -> torch.Tensor:
    """[B, T] log-probs of every sample, forward-only through the schedule, on every rank."""
    from megatron_gspo.model.pipeline import run_micro_batches, share_from_last_stage

    micro_batches = _packed(seqs, _plan(len(seqs)), pad_multiple)
    out = torch.zeros(len(seqs), max(len(s) for s in seqs))

    def keep(i, logprobs, _entropy):
        for row, sample in enumerate(micro_batches[i][0]):
            out[sample, : logprobs.shape[1]] = logprobs[row].detach().float().cpu()
        return logprobs.new_zeros(()), {}

    with torch.no_grad():
        run_micro_batches(ddp, [p for _, p in micro_batches], keep, forward_only=True)
    return share_from_last_stage(out)


def _one_step(model_cfg, parallel, seqs, masks, weights, args, source=None, *, pad_multiple=1):
    """Build, load weights, log-probs of every sample, one optimizer step on this DP rank's share.

    The step is Adam made linear in the gradient in fp32 (it compares gradients), plain Adam in
    bf16 (its mean is bounded).

    Both go through megatron's schedule (`model/pipeline.py`) in micro-batches of
    `MICRO_BATCH_SIZE`, so a pipeline has several micro-batches in flight. The weights are
    `weights` (global), else the checkpoint `source`, else the seeded random init. Every run
    packs with `pad_multiple` (the layout's).
    """
    from megatron.core import parallel_state as ps

    from megatron_gspo.model.aux_loss import AuxLossWeights, aux_loss_scale
    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.distributed import compute_device, init_distributed
    from megatron_gspo.model.engine import EngineConfig
    from megatron_gspo.model.optim import (
        build_optimizer,
        dp_loss_scale,
        optimizer_step,
        wrap_ddp,
        zero_grads,
    )
    from megatron_gspo.model.pipeline import run_micro_batches
    from megatron_gspo.model.sharding import gather_global_state_dict, load_global_state_dict

    init_distributed(parallel, seed=args.seed)
    engine = EngineConfig(dtype=args.dtype, recompute_activations=args.recompute)
    model = build_model(model_cfg, parallel, engine, aux_loss_coeff=_aux_coeff(model_cfg, args))
    if weights is not None:
        load_global_state_dict(model, weights)
    elif source is not None:
        _load_checkpoint(model, source, model_cfg)
    initial = gather_global_state_dict(model)
    ddp = wrap_ddp(model, distributed_optimizer=parallel.distributed_optimizer)
    optimizer, scheduler = build_optimizer(
        ddp,
        _optim_config(args),
        distributed_optimizer=parallel.distributed_optimizer,
    )
    logprobs = _schedule_logprobs(ddp, seqs, pad_multiple)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    plan = _plan(len(seqs))
    mine = plan[dp_rank::dp]
    micro_batches = _packed(seqs, mine or plan[:1], pad_multiple)  # none left: a zero-weight filler
    tokens = [sum(int(masks[s][1:].sum()) for s in chunk) if mine else 0 for chunk, _ in micro_batches]
    total_tokens = sum(int(m[1:].sum()) for m in masks)
    device = compute_device()
    aux = AuxLossWeights(
        [
            aux_loss_scale(torch.tensor(n, device=device), torch.tensor(total_tokens, device=device), dp)
            for n in tokens
        ]
    )

    def loss_fn(i, local_logprobs, _entropy):
        local_mask = torch.zeros_like(local_logprobs)
        for row, sample in enumerate(micro_batches[i][0]):
            local_mask[row, : len(masks[sample])] = masks[sample].to(device, torch.float32)
        local_mask[:, 0] = 0.0
        return -(local_logprobs * local_mask).sum() / total_tokens * dp_loss_scale() * bool(mine), {}

    zero_grads(ddp, optimizer)
    run_micro_batches(ddp, [p for _, p in micro_batches], loss_fn, forward_only=False, hooks=[aux])
    stepped, grad_norm = optimizer_step(ddp, optimizer, scheduler)
    if not stepped:
        raise RuntimeError("parity: the optimizer step was skipped (non-finite gradients)")
    return initial, logprobs, gather_global_state_dict(model), grad_norm


def _aux_coeff(model_cfg, args: argparse.Namespace) -> float:
    """The load-balancing loss coefficient of both runs: `--aux-loss-coeff`, else the model's."""
    return model_cfg.aux_loss_coeff if args.aux_loss_coeff is None else args.aux_loss_coeff


def _optim_config(args: argparse.Namespace):
    from megatron_gspo.model.optim import OptimConfig

    if args.dtype == "bf16":
        return OptimConfig(lr=LR, clip_grad=1.0)
    return OptimConfig(lr=LINEAR_ADAM_EPS, adam_eps=LINEAR_ADAM_EPS, clip_grad=1.0)


def _fp32_logprobs(model_cfg, parallel, seqs, weights, args) -> torch.Tensor:
    """Log-probs of `weights` (bf16 values) run in fp32: what bf16 rounding changes, at TP=1."""
    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.distributed import init_distributed
    from megatron_gspo.model.engine import EngineConfig
    from megatron_gspo.model.logprobs import sequence_logprobs
    from megatron_gspo.model.sharding import load_global_state_dict

    init_distributed(parallel, seed=args.seed)
    model = build_model(
        model_cfg, parallel, EngineConfig(dtype="fp32"), aux_loss_coeff=_aux_coeff(model_cfg, args)
    )
    load_global_state_dict(model, weights)
    with torch.no_grad():
        return sequence_logprobs(model, seqs)[0]


def _stages_text(layout, num_layers: int) -> str:
    """What the line says about the pipeline's split beyond `pp=`.

    ` stages=[1, 2, 3]` for an uneven pipeline, ` vpp=2 chunks=[[0, 2], [1, 3]]` (each chunk's
    first layer, per stage) for a virtual one, else nothing (the line stays as it was).
    """
    layers = layout.stage_layers(num_layers)
    text = f" stages={layers}" if len(set(layers)) > 1 else ""
    if layout.virtual_pipeline:
        firsts = [[first for first, _ in stage] for stage in layout.chunk_layers(num_layers)]
        text += f" vpp={layout.virtual_pipeline} chunks={firsts}"
    return text


@dataclass
class _Diffs:
    """|layout - TP=1| of the log-probs (over predicted tokens) and of the stepped weights.

    `step_rel`: the largest difference of the two steps (updated - initial weights) over the
    largest step, i.e. for SGD the gradients' largest difference relative to the largest gradient.
    """

    logprob_max: float
    logprob_mean: float
    weight_max: float
    weight_mean: float
    step_rel: float = 0.0

    @classmethod
    def of(cls, logprobs, ref_logprobs, seqs, updated=None, ref_updated=None, initial=None) -> _Diffs:
        predicted = torch.zeros_like(logprobs, dtype=torch.bool)
        for i, seq in enumerate(seqs):
            predicted[i, 1 : len(seq)] = True
        d = (logprobs - ref_logprobs).abs()[predicted]
        w_max = w_mean = step_rel = 0.0
        if updated is not None:
            w = torch.cat(
                [(updated[k].float() - ref_updated[k].float()).abs().flatten() for k in ref_updated]
            )
            w_max, w_mean = w.max().item(), w.mean().item()
        if initial is not None:
            largest = max((ref_updated[k].float() - initial[k].float()).abs().max().item() for k in initial)
            step_rel = w_max / largest if largest > 0 else math.inf
        return cls(d.max().item(), d.mean().item(), w_max, w_mean, step_rel)


def _check(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from megatron_gspo.errors import report_verdict
    from megatron_gspo.model import config as model_configs
    from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed

    bf16 = args.dtype == "bf16"
    source = None
    if args.hf_path:
        source, model_cfg = _checkpoint_model(args)
    else:
        init = {"init_std": BF16_INIT_STD} if bf16 else {}
        model_cfg = model_configs.tiny(vocab_size=96, num_layers=args.num_layers, **init)
    seqs, masks = _batch(model_cfg.vocab_size, args.seed)
    layout = _layout(args)
    # TP=1 with the layout's vocabulary padding: the same rows (an odd vocabulary is padded at TP2)
    reference = ParallelConfig(
        token_dispatcher=args.dispatcher,
        make_vocab_size_divisible_by=layout.make_vocab_size_divisible_by * layout.tensor_parallel,
    )
    pad = layout.pad_multiple
    weights, ref_logprobs, ref_updated, ref_norm = _one_step(
        model_cfg, reference, seqs, masks, None, args, source, pad_multiple=pad
    )
    if bf16:
        rounding = _Diffs.of(_fp32_logprobs(model_cfg, reference, seqs, weights, args), ref_logprobs, seqs)
    _, logprobs, updated, grad_norm = _one_step(
        model_cfg, layout, seqs, masks, weights, args, pad_multiple=pad
    )
    diffs = _Diffs.of(logprobs, ref_logprobs, seqs, updated, ref_updated, None if bf16 else weights)
    model = "tiny random model" if source is None else f"{source.path}"
    model += (
        f" ({model_cfg.num_layers} layers, {model_cfg.num_experts} experts top-{model_cfg.moe_topk}, "
        f"vocab {model_cfg.vocab_size})"
    )
    aux_coeff = _aux_coeff(model_cfg, args)
    aux_from = "--aux-loss-coeff" if args.aux_loss_coeff is not None else "the model's router_aux_loss_coef"
    head = (
        f"parity tp={args.tp} ep={args.ep} pp={args.pp}{_stages_text(layout, model_cfg.num_layers)} "
        f"dispatcher={args.dispatcher} dtype={args.dtype} "
        f"world={dist.get_world_size()} on {model} aux_loss_coeff={aux_coeff:g} ({aux_from}) "
        f"vs tp=1 ep=1: max|dlogprob|={diffs.logprob_max:.3e} "
        f"max|dweight| after one {'Adam' if bf16 else 'linear Adam'} step={diffs.weight_max:.3e} "
        f"grad_norm {grad_norm:.6f} vs {ref_norm:.6f}"
    )
    if bf16:
        grad_norm_rel = abs(grad_norm - ref_norm) / ref_norm
        ok = (
            diffs.logprob_mean <= BF16_FACTOR * rounding.logprob_mean
            and diffs.logprob_max <= BF16_FACTOR * rounding.logprob_max
            and diffs.weight_mean <= BF16_WEIGHT_MEAN
            and grad_norm_rel <= BF16_GRAD_NORM_REL
        )
        line = (
            f"{head} (rel {grad_norm_rel:.1e}) mean|dlogprob|={diffs.logprob_mean:.3e} "
            f"mean|dweight|={diffs.weight_mean:.3e}; bf16 vs fp32 at tp=1: "
            f"max|dlogprob|={rounding.logprob_max:.3e} mean|dlogprob|={rounding.logprob_mean:.3e} "
            f"-> {'OK' if ok else 'FAIL'} (bounds: log-probs {BF16_FACTOR:g}x bf16 vs fp32, "
            f"mean|dweight| {BF16_WEIGHT_MEAN:g}, grad norm rel {BF16_GRAD_NORM_REL:.2g})"
        )
    else:
        tolerance = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
        failed = [
            what
            for what, value in (
                ("log-probs", diffs.logprob_max),
                ("grad norm", abs(grad_norm - ref_norm)),
                ("gradients (the linear Adam step, relative to its largest)", diffs.step_rel),
            )
            if not value <= tolerance
        ]
        ok = not failed
        verdict = (
            "OK" if ok else f"FAIL: {', '.join(failed)} differ from tp=1 ep=1 by more than {tolerance:g}"
        )
        line = f"{head} step rel {diffs.step_rel:.3e} -> {verdict} (tolerance {tolerance:g})"
    if dist.get_rank() == 0:
        print(line, flush=True)
        if not ok:
            report_verdict(1)  # the line is the answer: the launcher shows no torchrun failure report
    destroy_distributed()
    return 0 if ok else 1
