"""Run packed micro-batches through megatron's forward-backward schedule (any pipeline size).

Every forward and backward of the policy goes through `megatron.core.pipeline_parallel.
get_forward_backward_func()`: the no-pipelining schedule without pipeline parallelism, 1F1B
with it. Each stage runs its own layers; megatron hands activations (and their shapes, which
vary with packing: `variable_seq_lengths`) between stages, and the last stage turns its
output into per-token log-probs and calls the caller's loss on them.

Per-micro-batch state is keyed by the micro-batch's index in the call, never by call order.
Under 1F1B several micro-batches are forwarded before the first backward, and activation
recompute re-runs a layer's forward inside its backward; so the index travels with the data
(the data iterator yields it) and `MicroBatchHooks` are told which micro-batch a forward or
a backward belongs to: `before_backward(i)` fires from a gradient hook on micro-batch i's
stage output, registered when that micro-batch was forwarded, i.e. right before autograd
walks (and recomputes) micro-batch i's layers.

The schedule divides the loss a micro-batch returns by the number of micro-batches (it
assumes a per-micro-batch mean); the callers here normalise globally themselves, so the loss
is handed over multiplied by that number and reaches backward unchanged. Megatron also sets
the MoE aux-loss gradient scale to 1 / num_microbatches after every forward; callers that
weight it per micro-batch set it in `before_backward`, which runs last.

The interleaved schedule (virtual pipeline) takes micro-batches in groups of the pipeline size
and refuses a count that is not a multiple of it (megatron-core 0.16 and 0.19 alike: the group
size defaults to PP, and a last group smaller than PP is an error). RL's micro-batch count
follows the data, so a run under a virtual pipeline is padded with filler micro-batches: copies
of the last real one whose loss and aux-loss gradient are zero. A filler runs the caller's hooks
as the micro-batch it copies (routing replay then replays that micro-batch's routes on the same
tokens, and a recording files the same routes again); `loss_fn` never sees it. The aux-loss scale
megatron sets from the padded count is set back to what it sets for the real count (its loss
scale is 1: fp16 is never on) before the caller's own `before_backward` hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from megatron_gspo.model.aux_loss import FillerAuxScale
from megatron_gspo.model.logprobs import stage_forward
from megatron_gspo.model.micro_batch_hooks import MicroBatchHooks, PerChunkHooks
from megatron_gspo.model.packing import PackedBatch, unpack

T = TypeVar("T")


def _chunk_view(hooks: Sequence[MicroBatchHooks], chunk: int) -> list[MicroBatchHooks]:
    """`hooks` as chunk `chunk` runs them (`PerChunkHooks` replaced by that chunk's)."""
    out: list[MicroBatchHooks] = []
    for hook in hooks:
        out.extend(hook.per_chunk[chunk] if isinstance(hook, PerChunkHooks) else [hook])
    return out


LossFn = Callable[[int, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict]]
"""(i, logprobs [B, T], entropy [B, T] or None) -> (loss of micro-batch i, metrics); last stage only."""


def run_micro_batches(
    model: torch.nn.Module,
    batches: Sequence[PackedBatch],
    loss_fn: LossFn,
    *,
    forward_only: bool,
    temperature: float = 1.0,
    with_entropy: bool = False,
    hooks: Sequence[MicroBatchHooks] = (),
    chunk_hooks: Sequence[Sequence[MicroBatchHooks]] = (),
) -> None:
    """Forward (and unless `forward_only`, backward) every micro-batch of `batches` on this stage.

    Collective over the pipeline group (and whatever the layers use). Gradients accumulate into
    the DDP buffers; reducing them and stepping is the caller's. `loss_fn` runs on the last
    stage only, once per micro-batch in order, on the unpacked log-probs; what it returns is
    backpropagated as is (see the module doc). Results the caller needs (log-probs, metrics)
    are the caller's to keep from inside `loss_fn`.

    Args:
        model: the (DDP-wrapped) policy stage of this rank (a `ModelChunks` under a virtual
            pipeline: the interleaved schedule then runs; hooks fire once per chunk).
        batches: packed micro-batches, identical on every stage of a pipeline.
        loss_fn: the loss of micro-batch i from its log-probs (and entropy).
        forward_only: no backward (pi_old recompute, recording, evaluation); call under no_grad.
        temperature: sampling temperature of the rollouts (logits are divided by it).
        with_entropy: also hand `loss_fn` the per-token entropy.
        hooks: per-micro-batch callbacks (routing replay, aux-loss weights); a `PerChunkHooks`
            among them fires per chunk, as `chunk_hooks` do.
        chunk_hooks: under a virtual pipeline, `chunk_hooks[c]` fire around chunk c's forwards and
            backwards only, so state is keyed by (chunk, micro-batch): e.g. a `KeyedRecording`
            per chunk's `RoutingReplay`, whose layers are the only ones a chunk's forward runs.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_gspo.model.chunks import model_chunks

    if not batches:
        return
    chunks = model_chunks(model)
    chunk_index = {id(chunk): c for c, chunk in enumerate(chunks)}
    real = len(batches)
    num = _interleaved_count(real, len(chunks)) if len(chunks) > 1 else real
    padding = FillerAuxScale(real, chunks[0].config) if num > real else None

    def forward_step(data_iterator, stage):
        index = next(data_iterator)
        i = min(index, real - 1)  # a filler runs as the last real micro-batch
        packed = batches[i]
        c = chunk_index[id(stage)]
        active = [*_chunk_view(hooks, c), *(chunk_hooks[c] if chunk_hooks else ())]
        if padding is not None:
            active = [*active, padding.filler()] if index >= real else [padding.real(), *active]
        for hook in active:
            hook.before_forward(i)
        output, entropy = stage_forward(stage, packed, temperature=temperature, with_entropy=with_entropy)
        for hook in active:
            hook.after_forward(i)
        if not forward_only and output.requires_grad:
            output.register_hook(_backward_start(active, i))

        def loss_func(neg_logprobs: torch.Tensor):
            if index >= real:
                return neg_logprobs.sum() * 0.0, {}  # a filler: no loss, no gradient
            logprobs = unpack(-neg_logprobs, packed)
            loss, metrics = loss_fn(i, logprobs, None if entropy is None else unpack(entropy, packed))
            return loss * num, metrics  # the schedule divides by `num`

        return output, loss_func

    rows = max(b.tokens.shape[0] for b in batches)
    length = max(b.tokens.shape[1] for b in batches)
    # The interleaved schedule (virtual pipeline) runs every micro-batch through each chunk in
    # turn and reads each chunk's data from its own iterator: the same indices, in order.
    indices = [iter(range(num)) for _ in chunks] if len(chunks) > 1 else iter(range(num))
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=indices,
        model=chunks,
        num_microbatches=num,
        seq_length=length,  # shapes travel with the activations (variable_seq_lengths)
        micro_batch_size=rows,
        forward_only=forward_only,
    )


def _interleaved_count(num: int, chunks: int) -> int:
    """The micro-batches the interleaved schedule runs for `num` real ones.

    A multiple of the pipeline size (megatron refuses others), and more than the first stage's
    warm-up forwards, 2 (PP - 1) + (V - 1) PP: when those cover every forward, stage 0 sends no
    gradient shapes while the last stage, in its steady state, exchanges both directions, and
    the shape exchange of variable-length micro-batches hangs (seen on gloo at PP = V = M = 2).
    """
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    count = -(-num // pp) * pp
    while count * chunks <= 2 * (pp - 1) + (chunks - 1) * pp:
        count += pp
    return count


def _backward_start(hooks: Sequence[MicroBatchHooks], i: int):
    """A gradient hook on micro-batch i's stage output: the first thing its backward runs."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        for h in hooks:
            h.before_backward(i)
        return grad

    return hook


def share_from_last_stage(obj: T) -> T:
    """The last pipeline stage's `obj` on every rank (control plane); `obj` itself without PP.

    Log-probs, losses and their metrics exist on the last stage only, and global rank 0 (which
    logs) is a first stage. The source is the last stage of rank 0's pipeline: megatron puts
    pipeline parallelism outermost, so it is global rank (PP - 1) x world / PP.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_gspo.model.control_plane import broadcast_from

    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return obj
    stride = dist.get_world_size() // pp
    ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    if ranks != [ranks[0] + k * stride for k in range(pp)]:
        raise RuntimeError(
            f"pipeline group {ranks} is not strided by world / PP: megatron's rank order moved"
        )
    return broadcast_from(obj, (pp - 1) * stride)
