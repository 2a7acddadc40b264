"""Per-token cross entropy over vocab-parallel logits, token chunk by token chunk.

Megatron's `vocab_parallel_cross_entropy` upcasts the whole logits tensor to fp32 and keeps
that copy, turned into the softmax, for its backward. For bf16 logits that is twice their
bytes on top of them: for Qwen3's 151,936-token vocabulary, 1.4 GB per 9,216-token micro-batch
on each TP4 rank. Here megatron's own steps (`VocabParallelCrossEntropy.calculate_*`, op for
op, so the values are bit-identical: tests/model/) run on chunks of tokens: a chunk is upcast,
divided by the sampling temperature, reduced over the tensor-parallel group and dropped; only
the per-token max and sum of exponentials are kept. The backward recomputes each chunk's
softmax from the saved logits (in their own dtype) and those two numbers and writes the
chunk's gradient over its logits, as megatron's CE turns the buffer it saved into the
gradient. Peak extra memory, forward or backward, is one fp32 chunk: at most 1/8 of the
logits' bytes above an 8 MiB floor (`chunk_tokens`). Logits small enough to be one chunk keep
their fp32 softmax for the backward instead, as megatron does (at most 8 MiB).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_gspo.model.distributed import all_reduce

MIN_CHUNK_BYTES = 8 * 2**20  # below this a chunk saves nothing worth the extra collectives
CHUNK_FRACTION = 8  # a chunk's fp32 copy is at most 1/8 of the logits' bytes


def chunk_rows(tokens: int, vocab: int, itemsize: int) -> int:
    """Tokens per chunk of [tokens, vocab] logits of `itemsize`-byte elements.

    As many fp32 rows of the vocabulary shard as fit in max(logits bytes / 8, 8 MiB).
    """
    budget = max(tokens * vocab * itemsize // CHUNK_FRACTION, MIN_CHUNK_BYTES)
    return max(1, budget // (vocab * 4))


def chunk_tokens(logits: torch.Tensor) -> int:
    """`chunk_rows` of a logits tensor [..., V / TP]."""
    vocab = logits.shape[-1]
    return chunk_rows(logits.numel() // max(vocab, 1), vocab, logits.element_size())


def _chunks(rows: int, step: int) -> Iterator[tuple[int, int]]:
    """[a, b) row ranges of `step` rows (the last one shorter)."""
    for a in range(0, rows, step):
        yield a, min(a + step, rows)


def _tp_group(group):
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group() if group is None else group


def _scaled_fp32(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """`chunk.float() / temperature` as a fresh tensor (the steps below work in place)."""
    if chunk.dtype == torch.float32:  # .float() would return the chunk itself
        return chunk / temperature if temperature != 1.0 else chunk.clone()
    x = chunk.float()
    return x.div_(temperature) if temperature != 1.0 else x


def _mask_padding(x: torch.Tensor, start: int, vocab_size: int | None) -> torch.Tensor:
    """Set the columns of global index >= `vocab_size` (megatron's TP padding) to -inf, in place.

    Args:
        x: [rows, V / TP] a fresh fp32 chunk of this rank's shard, whose first column is global `start`.
        start: global vocabulary index of the shard's first column.
        vocab_size: the real vocabulary (None: no padding).
    """
    if vocab_size is not None and start + x.shape[-1] > vocab_size:
        x[:, max(vocab_size - start, 0) :] = float("-inf")
    return x


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, temperature, group, vocab_size):
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as steps
        from megatron.core.tensor_parallel.utils import VocabUtility

        vocab = logits.shape[-1]
        flat, flat_target = logits.reshape(-1, vocab), target.reshape(-1)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            vocab, dist.get_rank(group), dist.get_world_size(group)
        )
        loss = torch.empty(flat_target.shape, dtype=torch.float32, device=logits.device)
        maxes, sums = torch.empty_like(loss), torch.empty_like(loss)
        step = chunk_tokens(logits)
        kept = None  # one chunk (small logits): its softmax is kept, as megatron keeps it
        for a, b in _chunks(flat.shape[0], step):
            scaled = _mask_padding(_scaled_fp32(flat[a:b], temperature), start, vocab_size)
            x, maxes[a:b] = steps.calculate_logits_max(scaled)
            del scaled
            dist.all_reduce(maxes[a:b], op=dist.ReduceOp.MAX, group=group)  # always, as megatron's CE
            target_mask, masked_target, predicted, sum_exp, exp_logits = steps.calculate_predicted_logits(
                x, flat_target[a:b], maxes[a:b], start, end
            )
            del x  # the same tensor as exp_logits: one fp32 chunk alive at a time
            both = torch.stack([predicted, sum_exp])  # one collective for the two sums megatron reduces
            dist.all_reduce(both, group=group)
            predicted, sums[a:b] = both[0], both[1]
            if b - a == flat.shape[0]:
                softmax, loss[a:b] = steps.calculate_cross_entropy_loss(exp_logits, predicted, sums[a:b])
                kept = (softmax, target_mask, masked_target)
            else:
                loss[a:b] = torch.log(sums[a:b]) - predicted  # calculate_cross_entropy_loss's loss
            del exp_logits
        if kept is not None:
            ctx.save_for_backward(*kept)
        else:
            ctx.save_for_backward(logits, target, maxes, sums)
        ctx.kept, ctx.dtype = kept is not None, logits.dtype
        ctx.temperature, ctx.vocab_range, ctx.step, ctx.vocab_size = (
            temperature,
            (start, end),
            step,
            vocab_size,
        )
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.kept:
            softmax, target_mask, masked_target = ctx.saved_tensors
            grad = _gradient(ctx, softmax, target_mask, masked_target, grad_output.reshape(-1))
            return grad.view(*grad_output.shape, -1), None, None, None, None
        logits, target, maxes, sums = ctx.saved_tensors
        vocab = logits.shape[-1]
        flat, flat_target = logits.reshape(-1, vocab), target.reshape(-1)
        flat_grad = grad_output.reshape(-1)
        # Each chunk's gradient overwrites its logits, which nothing reads again (megatron's CE
        # likewise turns the buffer it saved into the gradient): one fp32 chunk of extra memory.
        for a, b in _chunks(flat.shape[0], ctx.step):
            flat[a:b].copy_(
                _chunk_gradient(ctx, flat[a:b], flat_target[a:b], maxes[a:b], sums[a:b], flat_grad[a:b])
            )
        return logits, None, None, None, None


def _chunk_gradient(ctx, logits, target, maxes, sums, grad_output) -> torch.Tensor:
    """A chunk's d(loss)/d(logits), its softmax recomputed (its fp32 buffers die on return)."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as steps

    start, end = ctx.vocab_range
    x = _mask_padding(_scaled_fp32(logits, ctx.temperature), start, ctx.vocab_size)
    target_mask, masked_target, predicted, _, exp_logits = steps.calculate_predicted_logits(
        x, target, maxes, start, end
    )
    softmax, _ = steps.calculate_cross_entropy_loss(exp_logits, predicted, sums)
    return _gradient(ctx, softmax, target_mask, masked_target, grad_output)


def _gradient(ctx, softmax, target_mask, masked_target, grad_output) -> torch.Tensor:
    """d(loss)/d(logits) of a chunk from its softmax (consumed), in the logits' dtype."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as steps

    grad_2d, arange, update, grad_input = steps.prepare_gradient_calculation_operands(softmax, target_mask)
    grad = steps.calculate_gradients(grad_2d, arange, masked_target, update, grad_input, grad_output)
    if ctx.temperature != 1.0:
        grad.div_(ctx.temperature)  # the chain rule through logits / temperature
    return grad.to(ctx.dtype)


def chunked_vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    group=None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """-log softmax(logits / temperature)[target] per token, as megatron's vocab-parallel CE.

    Args:
        logits: [..., V / TP] this rank's vocabulary shard, any float dtype (kept as it is).
        target: [...] global token ids.
        temperature: the logits are divided by it first (in fp32).
        group: the tensor-parallel group (default megatron's).
        vocab_size: the real vocabulary; columns of global index >= it (megatron's TP
            padding) are left out of the softmax (None: none are).

    Returns:
        fp32 [...] losses; differentiable with respect to `logits` (the gradient has their dtype).
    """
    return _ChunkedVocabParallelCrossEntropy.apply(
        logits.contiguous(), target, temperature, _tp_group(group), vocab_size
    )


@torch.no_grad()
def chunked_vocab_parallel_entropy(
    logits: torch.Tensor, *, temperature: float = 1.0, group=None, vocab_size: int | None = None
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the whole vocabulary, per token (a metric, no grad).

    Same chunks as the cross entropy; at most two fp32 chunks alive at a time.

    Args:
        logits: [..., V / TP] this rank's vocabulary shard, any float dtype.
        temperature: the logits are divided by it first (in fp32).
        group: the tensor-parallel group (default megatron's).
        vocab_size: the real vocabulary, as in `chunked_vocab_parallel_cross_entropy`.

    Returns:
        fp32 [...] entropies in nats.
    """
    from megatron.core.tensor_parallel.utils import VocabUtility

    group = _tp_group(group)
    flat = logits.detach().reshape(-1, logits.shape[-1])
    start, _ = VocabUtility.vocab_range_from_per_partition_vocab_size(
        flat.shape[-1], dist.get_rank(group), dist.get_world_size(group)
    )
    padded = vocab_size is not None and start + flat.shape[-1] > vocab_size
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for a, b in _chunks(flat.shape[0], chunk_tokens(logits)):
        shifted = _mask_padding(_scaled_fp32(flat[a:b], temperature), start, vocab_size)
        peak = shifted.max(dim=-1).values
        all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted.sub_(peak.unsqueeze(-1))
        exp = shifted.exp()
        if padded:  # exp is 0 there; keep 0 * -inf from making the sum NaN
            shifted[:, max(vocab_size - start, 0) :] = 0.0
        sums = torch.stack([exp.sum(-1), torch.mul(exp, shifted, out=shifted).sum(-1)])
        del exp, shifted
        all_reduce(sums, group=group)
        out[a:b] = sums[0].log() - sums[1] / sums[0]
    return out.view(logits.shape[:-1])
