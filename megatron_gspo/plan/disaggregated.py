"""`megatron-gspo plan`: dry-run a run config for a cluster without building anything.

Validates the config for a world size exactly as `train` would, then prints how the
policy is sharded and a per-GPU memory estimate: model states (weights, fp32 grad buffers,
optimizer states; with the KL loss the frozen reference's weights, unless offloaded) and the
activations of one micro-batch (logits and the fp32 chunks the log-prob and entropy passes
work in, the tensors each layer keeps for backward, under no, selective or full activation
recompute), so a layout for H100 nodes can be checked on a laptop or in CI. A layout whose
estimate plus a reserve (CUDA context, NCCL buffers, allocator fragmentation) exceeds the GPU
memory is refused. Rank 0 has a second phase: the weight sync's buckets on its model states once
the step's activations are freed; the larger of the two decides. Communication overlap works in
megatron's own buffers (+0). It also prints the bytes each weight sync sends to a rollout server
(FP8 with rollout.quantization) and the host memory a checkpoint save needs per rank and per node,
routine and reshardable (`plan_checkpoint`).
With `--placement colocated` (`plan_colocated`) each phase of a colocated step is estimated
instead: generation (SGLang's weights and KV cache), training, weight sync.

Under pipeline parallelism every stage is estimated on its own: its share of the layers,
the embedding on the first stage, the final norm and output layer (with tied embeddings, the
output layer's copy of the embedding) and the logits on the last. Megatron's 1F1B schedule
keeps up to PP - s micro-batches in flight on stage s, so the first stage holds the most
activations; the stage that needs the most memory decides whether the layout fits.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from megatron_gspo.plan.colocated import add_colocated_args, colocated_plan

GIB = 1024**3


@dataclass
class ShardPlan:
    """Parameters and model-state bytes held by one rank (of one pipeline stage)."""

    dense_params: int
    expert_params: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    reference_bytes: int = 0
    """The KL loss's frozen reference: weights only, sharded like the policy's (0 when offloaded)."""

    @property
    def total_bytes(self) -> int:
        """Weights + grads + optimizer states (+ the reference's weights on the GPU)."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.reference_bytes


@dataclass(frozen=True)
class Stage:
    """What one pipeline stage holds: layers [first_layer, first_layer + layers), ends of the model."""

    index: int
    first_layer: int
    layers: int
    embedding: bool
    output: bool

    def describe(self) -> str:
        """`layers 0-46 + embedding`-style summary."""
        text = f"layers {self.first_layer}-{self.first_layer + self.layers - 1}"
        return text + " + embedding" * self.embedding + " + output layer" * self.output


def pipeline_stages(num_layers: int, parallel) -> list[Stage]:
    """The stages of `parallel`'s split of `num_layers` (even, or uneven: `ParallelConfig.stage_layers`)."""
    layers = parallel.stage_layers(num_layers)
    last = len(layers) - 1
    return [Stage(s, sum(layers[:s]), n, s == 0, s == last) for s, n in enumerate(layers)]


def _stage_params(model, stage: Stage, pipeline_parallel: int) -> tuple[int, int]:
    """(dense, expert) parameters of a stage, whole (before TP / EP splits)."""
    h, vocab = model.hidden_size, model.vocab_size
    expert_per_layer = model.num_experts * 3 * h * model.moe_ffn_hidden_size
    outside_layers = vocab * h * (1 if model.tie_word_embeddings else 2) + h  # embedding, output, norm
    dense_per_layer = (model.num_parameters - outside_layers) // model.num_layers - expert_per_layer
    dense = stage.layers * dense_per_layer
    if pipeline_parallel == 1:
        dense += outside_layers
    else:  # a tied output layer is a copy of the embedding on the last stage
        dense += vocab * h * stage.embedding + (vocab * h + h) * stage.output
    return dense, stage.layers * expert_per_layer


def shard_plan(model, parallel, engine, world_size: int, stage: Stage | None = None) -> ShardPlan:
    """Per-rank model-state estimate for `MoEModelConfig` x `ParallelConfig` x `EngineConfig`.

    Dense parameters (attention, norms, router, embeddings) are split over TP; expert
    parameters over EP x expert-TP; layers over the pipeline stages (`stage`, default the
    first). Grad buffers are fp32. Adam keeps two fp32 moments, plus an fp32 master copy when
    training in bf16; the distributed optimizer shards these over the data-parallel replicas
    of each parameter (world / (TP x PP) for dense, world / (EP x ETP x PP) for experts).
    """
    pp = parallel.pipeline_parallel
    stage = stage or pipeline_stages(model.num_layers, parallel)[0]
    model = model.replace(vocab_size=parallel.padded_vocab_size(model.vocab_size))  # rows megatron builds
    dense, expert = _stage_params(model, stage, pp)
    tp, ep, etp = parallel.tensor_parallel, parallel.expert_parallel, parallel.expert_tp
    dense_local, expert_local = dense // tp, expert // (ep * etp)
    weight_size = 2 if engine.dtype == "bf16" else 4
    optimizer_size = 8 + (4 if engine.dtype == "bf16" else 0)
    dense_dp, expert_dp = world_size // (tp * pp), world_size // (ep * etp * pp)
    if parallel.distributed_optimizer:
        optimizer = dense_local * optimizer_size / dense_dp + expert_local * optimizer_size / expert_dp
    else:
        optimizer = (dense_local + expert_local) * optimizer_size
    return ShardPlan(
        dense_params=dense_local,
        expert_params=expert_local,
        weight_bytes=(dense_local + expert_local) * weight_size,
        grad_bytes=(dense_local + expert_local) * 4,
        optimizer_bytes=int(optimizer),
    )


@dataclass
class ActivationPlan:
    """Activation bytes one rank holds at the peak of a micro-batch's forward/backward.

    Attributes:
        tokens: tokens of the micro-batch (responses x longest prompt + response) on this CP rank,
            all TP ranks'.
        logits_bytes: the output layer's [tokens, vocab / TP] logits in the compute dtype plus
            two fp32 token chunks of them, the most the chunked log-prob and entropy passes
            hold at once (`model/chunked_cross_entropy.py`).
        layer_bytes: tensors one transformer layer keeps for backward, for all tokens.
        stored_bytes: what the stage's layers hold at once, for `in_flight` micro-batches:
            every layer's `layer_bytes` without recompute; with full recompute, each layer's
            input, plus one layer rebuilt; with selective recompute, every layer's `layer_bytes`
            less what its recomputed modules discard (`layer_bytes` is then that smaller figure),
            plus one MoE block rebuilt when `moe` is among them.
        recompute: "full", "selective: <modules>" or "off".
        in_flight: micro-batches whose activations the stage holds at once (1F1B: PP - stage).
    """

    tokens: int
    logits_bytes: int
    layer_bytes: int
    stored_bytes: int
    recompute: str
    in_flight: int = 1

    @property
    def total_bytes(self) -> int:
        """Logits + layer activations."""
        return self.logits_bytes + self.stored_bytes


def layer_elements_per_token(
    model, parallel, *, flash_attention: bool, seq_len: int, recompute_modules=()
) -> tuple[float, float]:
    """Elements one layer keeps for backward per token of the micro-batch, on one rank.

    Counted from the layer's data path (bf16/fp32 compute dtype unless noted), sharded over TP
    (sequence parallelism shards the norm inputs, heads shard attention, tokens shard the MoE):
    attention keeps the two norm inputs, q/k/v, the q/k-norm inputs and the attention output
    (flash attention keeps no score matrix; megatron's local attention keeps scores and
    softmax, [heads/TP, seq_len] each). The MoE block keeps its norm and router inputs, the
    output, and per routed token (top-k of them, balanced routing assumed) the expert input,
    fc1's 2F output, the SwiGLU output and fc2's output; expert TP gathers its group's tokens.

    Selective recompute (`recompute_modules`) discards what each module rebuilds in the backward:
    core_attn the local attention's scores and softmax (flash attention keeps none), layernorm
    the pre-MLP norm's output (the router's input), moe_act the SwiGLU outputs, moe the whole MoE
    block but its input (router logits included).

    Returns:
        (compute-dtype elements, fp32 elements: router logits and probabilities).
    """
    h, d, f = model.hidden_size, model.head_dim, model.moe_ffn_hidden_size
    nq, nkv = model.num_attention_heads, model.num_query_groups
    tp, etp = parallel.tensor_parallel, parallel.expert_tp
    attention = 2 * h + (nq + 2 * nkv) * d + (nq + nkv) * d + nq * d
    if not flash_attention and "core_attn" not in recompute_modules:
        attention += 2 * nq * seq_len
    moe = 3 * h + model.moe_topk * (2 * h * etp + 3 * f)
    moe -= h * ("layernorm" in recompute_modules) + model.moe_topk * f * ("moe_act" in recompute_modules)
    if "moe" in recompute_modules:
        return (attention + h) / tp, 0.0
    return (attention + moe) / tp, 2 * model.num_experts / tp


def activation_plan(
    model, parallel, engine, *, tokens: int, seq_len: int, flash_attention: bool, stage: Stage | None = None
) -> ActivationPlan:
    """Activation estimate of micro-batches of `tokens` tokens (rows up to `seq_len` long) on one rank.

    `stage` (default: the first, or the only one) decides the layers held, the micro-batches
    in flight (PP - stage index under 1F1B) and whether the logits are there (last stage).
    Under context parallelism each rank holds 1 / CP of every sequence: its layer activations
    and logits are those of tokens / CP (only the per-token log-probs are gathered).
    """
    tokens = -(-tokens // parallel.context_parallel)
    pp = parallel.pipeline_parallel
    stage = stage or pipeline_stages(model.num_layers, parallel)[0]
    in_flight = pp - stage.index
    size = 2 if engine.dtype == "bf16" else 4
    tp = parallel.tensor_parallel
    vocab_local = parallel.padded_vocab_size(model.vocab_size) // tp  # megatron pads it for TP
    logits = 0
    if stage.output:
        from megatron_gspo.model.chunked_cross_entropy import chunk_rows

        chunk = min(tokens, chunk_rows(tokens, vocab_local, size)) * vocab_local * 4
        logits = tokens * vocab_local * size + 2 * chunk
    modules = engine.selective_modules
    shape = dict(flash_attention=flash_attention, seq_len=seq_len)
    elements, fp32 = layer_elements_per_token(model, parallel, **shape, recompute_modules=modules)
    layer = int(tokens * (elements * size + fp32 * 4))
    recompute = {"full": "full", "selective": f"selective: {', '.join(modules)}"}.get(engine.recompute, "off")
    if engine.recompute == "full":  # megatron full/uniform/1: each layer's [tokens / TP, H] input kept
        stored = in_flight * stage.layers * tokens * model.hidden_size // tp * size + layer
    else:
        stored = in_flight * stage.layers * layer
    if "moe" in modules:  # one layer's MoE block rebuilt at a time in the backward
        whole, whole_fp32 = layer_elements_per_token(model, parallel, **shape)
        stored += int(tokens * ((whole - elements) * size + whole_fp32 * 4))
    return ActivationPlan(tokens, logits, layer, stored, recompute, in_flight)


def micro_batch_shape(cfg, task, world_size: int) -> tuple[int, int, str]:
    """(tokens of the largest micro-batch on one data-parallel rank, longest sequence, description).

    By count: responses x the longest sequence; by tokens: the budget
    (`trainer.max_tokens_per_micro_batch`), whatever the mix of lengths.
    """
    dp = cfg.parallel.check_world_size(world_size)
    from megatron_gspo.config import prompts_start_with_bos

    seq_len = task.max_prompt_len + int(prompts_start_with_bos(cfg)) + cfg.rollout.max_new_tokens
    budget = cfg.trainer.max_tokens_per_micro_batch
    if budget:
        return budget, seq_len, f"of up to {budget} tokens (trainer.max_tokens_per_micro_batch)"
    per_rank = (
        cfg.rollout.rollout_batch_size * cfg.rollout.group_size // (cfg.algorithm.num_mini_batches * dp)
    )
    responses = min(cfg.trainer.micro_batch_size or per_rank, per_rank)
    return responses * seq_len, seq_len, f"{responses} x {seq_len} = {responses * seq_len} tokens"


H100_USABLE_GIB = 79.1
"""An H100 80GB's capacity as torch reports it ("total capacity of 79.10 GiB"): 80 GB is not 80 GiB."""


def _at_least(kind: type, low: float, what: str):
    """An argparse type: `kind` of `text`, refused (exit 2, naming the option) below `low`."""

    def parse(text: str):
        value = kind(text)
        if not value >= low:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" error
    return parse


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megatron-gspo plan`."""
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument(
        "--world-size",
        type=_at_least(int, 1, "a whole number >= 1"),
        required=True,
        help="training ranks (GPUs)",
    )
    parser.add_argument(
        "--gpu-memory-gb",
        type=_at_least(float, 1e-9, "> 0"),
        default=H100_USABLE_GIB,
        help=f"memory per GPU in GiB (default {H100_USABLE_GIB:g}: what an H100 80GB gives torch)",
    )
    parser.add_argument(
        "--reserve-gb",
        type=_at_least(float, 0.0, ">= 0"),
        default=6.0,
        help="kept free for the CUDA context, NCCL buffers and allocator fragmentation",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=_at_least(int, 1, "a whole number >= 1"),
        default=8,
        help="ranks per node, for the host memory of a save",
    )
    add_colocated_args(parser)
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. parallel.expert_parallel=8")


@dataclass
class StagePlan:
    """Model states and activations of one rank of one pipeline stage."""

    stage: Stage
    states: ShardPlan
    activation: ActivationPlan
    activation_no_recompute: ActivationPlan
    activation_full_recompute: ActivationPlan

    @property
    def total_bytes(self) -> int:
        """Model states + activations."""
        return self.states.total_bytes + self.activation.total_bytes


def with_reference(plan: ShardPlan, cfg) -> ShardPlan:
    """`plan` plus the KL reference's weights (same shard, same dtype, no grads or optimizer).

    With `model.ref_offload` they sit in pinned host memory outside the reference's own pass,
    so they add nothing to the training peak (`run_plan` checks the reference pass apart).
    """
    if not cfg.algorithm.use_kl_loss or cfg.model.ref_offload:
        return plan
    return dataclasses.replace(plan, reference_bytes=plan.weight_bytes)


def stage_plans(cfg, model, world_size: int, *, tokens: int, seq_len: int) -> list[StagePlan]:
    """Every pipeline stage's estimate (one entry without pipeline parallelism)."""
    flash = cfg.engine.use_te is not False  # the TE spec's fused attention on a GPU node
    off = dict(recompute_activations=False, recompute_modules=None)
    no_recompute = dataclasses.replace(cfg.engine, **off, recompute_granularity=None)
    full = dataclasses.replace(cfg.engine, **off, recompute_granularity="full")
    plans = []
    for stage in pipeline_stages(model.num_layers, cfg.parallel):
        kwargs = dict(tokens=tokens, seq_len=seq_len, flash_attention=flash, stage=stage)
        plans.append(
            StagePlan(
                stage,
                with_reference(shard_plan(model, cfg.parallel, cfg.engine, world_size, stage), cfg),
                activation_plan(model, cfg.parallel, cfg.engine, **kwargs),
                activation_plan(model, cfg.parallel, no_recompute, **kwargs),
                activation_plan(model, cfg.parallel, full, **kwargs),
            )
        )
    return plans


def _fp8_bytes(rows: int, cols: int) -> int:
    """One FP8 weight with its float32 scale per 128x128 block."""
    return rows * cols + -(-rows // 128) * -(-cols // 128) * 4


def sync_bytes(model, dtype_size: int, quantization: str = "none") -> int:
    """Bytes one weight sync sends to each rollout server (the HF tensors of the policy).

    With `rollout.quantization=fp8` the decoder projections (attention q/k/v/o, every expert's
    gate/up/down) travel as FP8 plus scales (`model/fp8/blockwise.py`); embeddings, lm_head, norms and
    router gates stay in the trainer's dtype.
    """
    h, d = model.hidden_size, model.head_dim
    q, kv, f = model.num_attention_heads * d, model.num_query_groups * d, model.moe_ffn_hidden_size
    projections = [(q, h), (kv, h), (kv, h), (h, q)] + [(f, h), (f, h), (h, f)] * model.num_experts
    kept = model.num_experts * h + 2 * h + 2 * d  # router gate, two layer norms, q/k norms
    if quantization == "fp8":
        layer = sum(_fp8_bytes(r, c) for r, c in projections) + kept * dtype_size
    else:
        layer = (sum(r * c for r, c in projections) + kept) * dtype_size
    ends = (model.vocab_size * h * (1 if model.tie_word_embeddings else 2) + h) * dtype_size
    return model.num_layers * layer + ends


def sync_sender_bytes(model, parallel, engine, weight_sync) -> int:
    """Device memory the weight sync's sender (global rank 0) holds beyond its model states.

    `model/hf/stream.py`: the bucket being filled, the flattened copy of the one being sent, and
    one gathered global tensor in flight, at most the (TP-padded) embedding or output layer. The
    train step's activations are gone by then, so this is a phase of its own on rank 0's stage.
    """
    size = 2 if engine.dtype == "bf16" else 4
    largest = parallel.padded_vocab_size(model.vocab_size) * model.hidden_size * size
    return 2 * int(weight_sync.bucket_mb * 2**20) + largest


def overlap_text(parallel, dp: int) -> str:
    """What megatron's communication overlap costs in memory (nothing: it works in its buffers)."""
    if not parallel.overlap_grad_reduce:
        return "communication overlap: off (parallel.overlap_grad_reduce, overlap_param_gather)"
    bucket = max(40_000_000, 1_000_000 * dp)  # megatron DDP's default bucket_size
    gather = " and parameter all-gather (under the next forward)" if parallel.overlap_param_gather else ""
    return (
        f"communication overlap: gradient reduction (under the backward){gather} in buckets of "
        f"{bucket / 1e6:.0f}M parameters, in place in megatron's grad / param buffers (counted above): +0 GiB"
    )


def run_plan(args: argparse.Namespace) -> int:
    """Validate and print the plan; non-zero exit when the estimate does not fit the GPU."""
    from megatron_gspo.config import build_model_config, build_task, load_config, validate

    placement = [] if args.placement == "config" else [f"rollout.placement={args.placement}"]
    cfg = load_config(args.config, [*args.overrides, *placement])
    validate(cfg, world_size=args.world_size)
    model = build_model_config(cfg)
    tokens, seq_len, cut = micro_batch_shape(cfg, build_task(cfg), args.world_size)
    stages = stage_plans(cfg, model, args.world_size, tokens=tokens, seq_len=seq_len)
    p = cfg.parallel
    shape = f"{model.num_layers} layers, {model.num_experts} experts top-{model.moe_topk}"
    print(
        f"{args.config}: {model.num_parameters / 1e9:.1f}B parameters ({shape}) on {args.world_size} ranks: "
        f"TP={p.tensor_parallel} PP={p.pipeline_parallel} EP={p.expert_parallel} ETP={p.expert_tp} "
        f"DP={p.check_world_size(args.world_size)} SP={p.use_sequence_parallel} "
        + (f"CP={p.context_parallel} " if p.context_parallel > 1 else "")
        + f"distributed optimizer={p.distributed_optimizer} dtype={cfg.engine.dtype}"
    )
    if len(stages) > 1:
        for sp in stages:
            print(
                f"stage {sp.stage.index}: {sp.stage.describe()}: model states "
                f"{sp.states.total_bytes / GIB:.1f} GiB + activation "
                f"{sp.activation.total_bytes / GIB:.1f} GiB "
                f"({sp.activation.in_flight} micro-batch(es) in flight) = {sp.total_bytes / GIB:.1f} GiB"
            )
    worst = max(stages, key=lambda sp: sp.total_bytes)
    plan, act, no_recompute = worst.states, worst.activation, worst.activation_no_recompute
    where = f"stage {worst.stage.index} (the largest), " if len(stages) > 1 else ""
    print(
        f"per rank: {where}{plan.dense_params / 1e6:.0f}M dense + {plan.expert_params / 1e6:.0f}M expert "
        f"params; weights {plan.weight_bytes / GIB:.1f} GiB, grads {plan.grad_bytes / GIB:.1f} GiB, "
        f"optimizer {plan.optimizer_bytes / GIB:.1f} GiB"
        + (f", reference weights {plan.reference_bytes / GIB:.1f} GiB" if plan.reference_bytes else "")
        + f" = {plan.total_bytes / GIB:.1f} GiB model states"
    )
    if cfg.algorithm.use_kl_loss:
        ref = plan.weight_bytes / GIB
        if cfg.model.ref_offload:
            peak = (plan.total_bytes + plan.weight_bytes + act.logits_bytes) / GIB
            where_ref = (
                f"in pinned host memory between its passes (model.ref_offload); its no-grad pass holds "
                f"model states + {ref:.1f} + logits {act.logits_bytes / GIB:.1f} = {peak:.1f} GiB"
            )
        else:
            where_ref = "on the GPU (included above; model.ref_offload=true moves it to host memory)"
        print(f"reference model (KL loss): {cfg.engine.dtype} weights {ref:.1f} GiB per rank, {where_ref}")
    full = worst.activation_full_recompute
    print(
        f"activation: micro-batch {cut}; logits "
        f"{act.logits_bytes / GIB:.1f} GiB ({cfg.engine.dtype} [tokens, vocab/TP] + two fp32 chunks), "
        f"layers {act.stored_bytes / GIB:.1f} GiB with recompute {act.recompute} "
        f"(recompute off: {no_recompute.stored_bytes / GIB:.1f} GiB; full: "
        f"{full.stored_bytes / GIB:.1f} GiB; one layer {act.layer_bytes / GIB:.2f} GiB) "
        f"= {act.total_bytes / GIB:.1f} GiB"
    )
    print(overlap_text(p, p.check_world_size(args.world_size)))
    dtype_size = 2 if cfg.engine.dtype == "bf16" else 4
    sent = sync_bytes(model, dtype_size, cfg.rollout.quantization)
    unquantised = sync_bytes(model, dtype_size)
    print(
        f"weight sync: {sent / GIB:.1f} GiB to each rollout server per step"
        + (
            f" (rollout.quantization=fp8: {sent / unquantised:.2f}x the {unquantised / GIB:.1f} GiB "
            f"in {cfg.engine.dtype})"
            if cfg.rollout.quantization == "fp8"
            else ""
        )
    )
    sender = sync_sender_bytes(model, p, cfg.engine, cfg.weight_sync)
    rank0 = stages[0].states.total_bytes + sender
    print(
        f"weight sync, rank 0: {sender / GIB:.1f} GiB of buffers (2 x weight_sync.bucket_mb="
        f"{cfg.weight_sync.bucket_mb:g} + the largest tensor) on its "
        f"{stages[0].states.total_bytes / GIB:.1f} GiB of model states = {rank0 / GIB:.1f} GiB, "
        "after the step's activations are freed"
    )
    print_save_host_memory(stages, cfg, args.world_size, args.gpus_per_node)
    if cfg.rollout.placement == "colocated":
        return colocated_plan(args, cfg, model, plan, act.total_bytes, sender)
    train = plan.total_bytes + act.total_bytes
    need = max(train, rank0) + args.reserve_gb * GIB
    over = need - args.gpu_memory_gb * GIB
    sync_peak = f"; rank 0's weight sync + reserve {need / GIB:.1f} GiB" if rank0 > train else ""
    print(
        f"per GPU: {plan.total_bytes / GIB:.1f} model states + {act.total_bytes / GIB:.1f} activation + "
        f"{args.reserve_gb:g} reserve = {(train + args.reserve_gb * GIB) / GIB:.1f} GiB{sync_peak} "
        f"of {args.gpu_memory_gb:g} GiB"
    )
    if over <= 0:
        print(f"fits ({-over / GIB:.1f} GiB to spare)")
        return 0
    print(
        f"DOES NOT FIT: {over / GIB:.1f} GiB over the {args.gpu_memory_gb:g} GiB GPU; raise "
        "expert_parallel / tensor_parallel / pipeline_parallel, use the distributed optimizer, set "
        "engine.recompute_granularity (selective modules, or full) or lower trainer.micro_batch_size / "
        "trainer.max_tokens_per_micro_batch"
    )
    return 1


def print_save_host_memory(stages: list[StagePlan], cfg, world_size: int, gpus_per_node: int) -> None:
    """One line: host memory of a checkpoint save per rank and per node (the largest stage's)."""
    from megatron_gspo.plan.checkpoint_memory import save_host_memory

    host = max(
        (save_host_memory(sp.states, cfg.parallel, cfg.engine, world_size) for sp in stages),
        key=lambda h: h.reshardable_bytes,
    )
    node = min(gpus_per_node, world_size)
    print(
        f"checkpoint save, host memory: routine {host.routine_bytes / GIB:.1f} GiB per rank, "
        f"{host.routine_bytes * node / GIB:.1f} GiB per node of {node}; reshardable "
        f"{host.reshardable_bytes / GIB:.1f} GiB per rank, {host.reshardable_bytes * node / GIB:.1f} GiB "
        f"per node (trainer.reshardable_every={cfg.trainer.reshardable_every}, "
        f"reshardable_at_end={cfg.trainer.reshardable_at_end})"
    )
