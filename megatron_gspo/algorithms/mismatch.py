"""Rollout/trainer log-prob mismatch statistics, overall and by response-length bucket.

``d_it = log pi_trainer(y_it) - log pi_rollout(y_it)`` on response tokens, the trainer holding
the rollout weights. Per bucket of responses: mean |d| over tokens, the k3 estimate of
KL(pi_rollout || pi_trainer) over tokens (``exp(d) - 1 - d``, from the rollout's samples) and the
mean over responses of the sequence log-ratio ``mean_t d_it`` (what GSPO's ratio sees).

Buckets are powers of two of the response length: bucket b holds lengths [2^b, 2^(b+1) - 1]
(1, 2-3, 4-7, 8-15, ...), the last one (b = 19) everything from 2^19 tokens on. Short and long
responses then land in separate rows whatever the length cap, and each row spans the same
factor of lengths.

Sums, not means, are accumulated (:func:`mismatch_sums`, on the tensors' device, no host
sync) so micro-batches and data-parallel ranks add up before :func:`mismatch_by_length` divides.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_gspo.algorithms.inputs import zero_masked

NUM_LENGTH_BUCKETS = 20
# Columns of the sums: responses, tokens, sum |d|, sum k3, sum over responses of mean_t d.
SUM_COLUMNS: tuple[str, ...] = ("sequences", "tokens", "abs_diff", "k3", "seq_log_ratio")
_K3_BOUND = 20.0  # exp(20) stays finite; beyond it the estimate is meaningless anyway


def bucket_bounds(bucket: int) -> tuple[int, int | None]:
    """(shortest, longest) response length of a bucket; longest is None for the last, open one."""
    if bucket == NUM_LENGTH_BUCKETS - 1:
        return 2**bucket, None
    return 2**bucket, 2 ** (bucket + 1) - 1


def bucket_label(bucket: int) -> str:
    """``1``, ``2-3``, ``4-7``, ... and ``524288+`` for the last bucket."""
    low, high = bucket_bounds(bucket)
    if high is None:
        return f"{low}+"
    return str(low) if low == high else f"{low}-{high}"


def mismatch_sums(logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """Per-bucket sums of one batch (rows without response tokens are ignored).

    Args:
        logprobs: [B, T] the trainer's log-probs of the sampled tokens.
        rollout_logprobs: [B, T] the rollout engine's log-probs of the same tokens.
        response_mask: [B, T] bool or 0/1.

    Returns:
        [NUM_LENGTH_BUCKETS, len(SUM_COLUMNS)] float64 on ``logprobs``' device.
    """
    mask = response_mask.bool()
    d = zero_masked(logprobs.detach().double() - rollout_logprobs.detach().double(), mask)
    clamped = d.clamp(-_K3_BOUND, _K3_BOUND)
    k3 = zero_masked(torch.expm1(clamped) - clamped, mask)
    lengths = mask.sum(dim=-1).double()
    present = (lengths > 0).double()
    per_row = torch.stack(
        [present, lengths, d.abs().sum(dim=-1), k3.sum(dim=-1), d.sum(dim=-1) / lengths.clamp(min=1)],
        dim=-1,
    )
    bucket = torch.log2(lengths.clamp(min=1)).floor().long().clamp(max=NUM_LENGTH_BUCKETS - 1)
    sums = torch.zeros(NUM_LENGTH_BUCKETS, len(SUM_COLUMNS), dtype=torch.float64, device=d.device)
    return sums.index_add_(0, bucket, per_row)


def mismatch_by_length(sums: Tensor) -> list[dict]:
    """Rows of the non-empty buckets, shortest first.

    Args:
        sums: [NUM_LENGTH_BUCKETS, len(SUM_COLUMNS)] from :func:`mismatch_sums` (summed over
            micro-batches and ranks).

    Returns:
        Per bucket: ``bucket`` (label), ``min_length``, ``max_length`` (None: open),
        ``num_sequences``, ``num_tokens``, ``abs_diff_mean``, ``kl_k3``, ``log_seq_ratio_mean``.
    """
    rows = []
    for b, (seqs, tokens, abs_diff, k3, seq_log_ratio) in enumerate(sums.double().cpu().tolist()):
        if seqs == 0:
            continue
        low, high = bucket_bounds(b)
        rows.append(
            {
                "bucket": bucket_label(b),
                "min_length": low,
                "max_length": high,
                "num_sequences": int(seqs),
                "num_tokens": int(tokens),
                "abs_diff_mean": abs_diff / tokens,
                "kl_k3": k3 / tokens,
                "log_seq_ratio_mean": seq_log_ratio / seqs,
            }
        )
    return rows
