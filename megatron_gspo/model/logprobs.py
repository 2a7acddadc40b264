"""Per-token log-probs and entropy of given token sequences, from vocab-parallel logits.

Glossary (shapes): a micro-batch of B variable-length samples (prompt + response token ids)
is *packed* into R rows of L tokens; per-token values come back as [B, T] (T = longest
sample), aligned with the tokens: `logprobs[b, t] = log p(tokens[b, t] | tokens[b, :t])`,
and `logprobs[b, 0] = 0` (nothing predicts the first token).

Packing puts several samples in one row with a block-diagonal causal mask (local spec) or
THD `PackedSeqParams` (TransformerEngine), so padding does not dominate compute, and the
result does not depend on how samples are packed: attention never crosses samples and RoPE
depends only on relative positions. Log-probs come from megatron's GPTModel `labels` path
(`vocab_parallel_cross_entropy`): each TP rank keeps only its vocabulary slice, the CE
works in place on the logits and saves them as its softmax, so no second full-size copy of
the logits exists. Entropy (a metric, no gradient) is computed from the same logits in
token chunks inside a forward hook, before the CE consumes them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

ENTROPY_CHUNK_TOKENS = 1024


@dataclass
class PackedBatch:
    """Samples packed into rows.

    Attributes:
        tokens: [R, L] token ids, 0 in padding.
        labels: [R, L] next token of each position within its sample (0 where there is none).
        position_ids: [R, L] position of each token within its own sample.
        attention_mask: [R, 1, L, L] bool, True = masked (block-diagonal causal); None with THD.
        segments: per sample, (row, start, length), in the samples' original order.
        cu_seqlens: [num_samples + 1] int32 offsets of samples in the flattened rows (THD path).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    segments: list[tuple[int, int, int]]
    cu_seqlens: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        """Number of samples packed."""
        return len(self.segments)

    @property
    def max_len(self) -> int:
        """Longest sample."""
        return max(length for _, _, length in self.segments)

    @property
    def padding_fraction(self) -> float:
        """Fraction of row positions that hold no token."""
        used = sum(length for _, _, length in self.segments)
        return 1.0 - used / self.tokens.numel()


def pack_sequences(
    sequences: list[torch.Tensor] | list[list[int]],
    *,
    row_len: int | None = None,
    pad_multiple: int = 1,
    block_mask: bool = True,
    min_rows: int = 1,
) -> PackedBatch:
    """Pack variable-length samples into rows (first-fit decreasing).

    Args:
        sequences: B samples, each a 1-D sequence of token ids (length >= 1).
        row_len: capacity of a row; default the longest sample. Rounded up to `pad_multiple`.
        pad_multiple: row length multiple (tensor-parallel size under sequence parallelism).
        block_mask: build the [R, 1, L, L] mask (local spec); False for the THD path.
        min_rows: pad with empty rows up to this many (uniform shapes across ranks).
    """
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    if not seqs:
        raise ValueError("pack_sequences: no samples")
    lengths = [len(s) for s in seqs]
    if min(lengths) < 1:
        raise ValueError(f"pack_sequences: sample {lengths.index(0)} is empty")
    capacity = max(row_len or 0, max(lengths))
    capacity = -(-capacity // pad_multiple) * pad_multiple
    rows: list[int] = []  # used length per row
    segments: list[tuple[int, int, int]] = [(0, 0, 0)] * len(seqs)
    for i in sorted(range(len(seqs)), key=lambda j: -lengths[j]):
        row = next((r for r, used in enumerate(rows) if used + lengths[i] <= capacity), None)
        if row is None:
            rows.append(0)
            row = len(rows) - 1
        segments[i] = (row, rows[row], lengths[i])
        rows[row] += lengths[i]
    rows += [0] * max(0, min_rows - len(rows))
    R, L = len(rows), capacity
    tokens = torch.zeros(R, L, dtype=torch.long)
    labels = torch.zeros(R, L, dtype=torch.long)
    position_ids = torch.zeros(R, L, dtype=torch.long)
    mask = torch.ones(R, 1, L, L, dtype=torch.bool) if block_mask else None
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    for seq, (row, start, n) in zip(seqs, segments):
        tokens[row, start : start + n] = seq
        labels[row, start : start + n - 1] = seq[1:]
        position_ids[row, start : start + n] = torch.arange(n)
        if mask is not None:
            mask[row, 0, start : start + n, start : start + n] = ~causal[:n, :n]
    order = sorted(range(len(seqs)), key=lambda j: (segments[j][0], segments[j][1]))
    cu = torch.tensor(
        [0] + [segments[j][0] * L + segments[j][1] + lengths[j] for j in order], dtype=torch.int32
    )
    return PackedBatch(tokens, labels, position_ids, mask, segments, None if block_mask else cu)


def unpack(values: torch.Tensor, packed: PackedBatch, *, shift: bool = True) -> torch.Tensor:
    """[R, L] per-position values -> [B, T] per-sample values (right-padded with 0).

    With `shift`, a value computed at position t (about token t + 1) lands on token t + 1,
    so the result is aligned with the tokens (column 0 is 0).
    """
    T = packed.max_len
    out = values.new_zeros(packed.num_samples, T)
    for b, (row, start, n) in enumerate(packed.segments):
        if shift:
            out[b, 1:n] = values[row, start : start + n - 1]
        else:
            out[b, :n] = values[row, start : start + n]
    return out


def uniform_shape(packed: PackedBatch) -> tuple[int, int]:
    """Largest (rows, row length) over the ranks that exchange tokens in MoE layers.

    Expert-parallel ranks hold different data-parallel samples but exchange tokens every
    MoE layer; the allgather dispatcher needs equal token counts on all of them.
    """
    from megatron.core import parallel_state as ps

    group = ps.get_expert_tensor_and_model_parallel_group()
    shape = torch.tensor(packed.tokens.shape, dtype=torch.long)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
    return int(shape[0]), int(shape[1])


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def _vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax over the full vocabulary from a vocab shard [..., V/tp] (no grad)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    flat = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], ENTROPY_CHUNK_TOKENS):
        chunk = flat[start : start + ENTROPY_CHUNK_TOKENS].float()
        peak = chunk.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = chunk - peak.unsqueeze(-1)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])
        dist.all_reduce(sums, group=group)
        out[start : start + chunk.shape[0]] = sums[0].log() - sums[1] / sums[0]
    return out.view(logits.shape[:-1])


@contextlib.contextmanager
def _logits_hook(model: torch.nn.Module, temperature: float, want_entropy: bool, found: dict):
    """Divide the output layer's logits by the temperature and measure their entropy."""

    def hook(module, inputs, output):
        logits, bias = output
        if temperature != 1.0:
            logits = logits / temperature
        if want_entropy:
            found["entropy"] = _vocab_parallel_entropy(logits)  # [S, R]
        return logits, bias

    handle = _unwrap(model).output_layer.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def packed_forward(
    model: torch.nn.Module,
    packed: PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the policy on packed rows; returns per-position (log-prob of the next token, entropy).

    Both are [R, L]; the log-prob at (r, t) is that of `packed.labels[r, t]` (keeps the
    autograd graph), meaningful only where that label exists.

    Args:
        model: a megatron GPTModel (optionally wrapped by megatron DDP).
        packed: from `pack_sequences`.
        temperature: logits are divided by it first (match the rollout engine's sampling
            temperature, as SGLang's returned log-probs are log_softmax(logits / T)).
        with_entropy: also compute the entropy of every position's distribution.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    device = next(model.parameters()).device
    found: dict = {}
    kwargs = {}
    if packed.cu_seqlens is not None:
        kwargs["packed_seq_params"] = _thd_params(packed, device)
    with _logits_hook(model, temperature, with_entropy, found):
        neg_logprobs = model(
            packed.tokens.to(device),
            packed.position_ids.to(device),
            None if packed.attention_mask is None else packed.attention_mask.to(device),
            labels=packed.labels.to(device),
            **kwargs,
        )
    entropy = found["entropy"].transpose(0, 1) if with_entropy else None
    return -neg_logprobs, entropy


def _thd_params(packed: PackedBatch, device):
    """THD packed-sequence parameters for TransformerEngine attention (GPU path)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = packed.cu_seqlens.to(device)
    max_len = packed.max_len
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )


def sequence_logprobs(
    model: torch.nn.Module,
    sequences: list[torch.Tensor] | list[list[int]],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    row_len: int | None = None,
    pad_multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of B samples, [B, T], aligned with their tokens.

    `logprobs[b, t]` is the log-prob of token t given tokens < t; column 0 and padding are 0.
    """
    packed = pack_sequences(sequences, row_len=row_len, pad_multiple=pad_multiple)
    rows, length = uniform_shape(packed)
    if (rows, length) != tuple(packed.tokens.shape):
        packed = pack_sequences(sequences, row_len=length, pad_multiple=pad_multiple, min_rows=rows)
    logprobs, entropy = packed_forward(model, packed, temperature=temperature, with_entropy=with_entropy)
    return unpack(logprobs, packed), None if entropy is None else unpack(entropy, packed)
