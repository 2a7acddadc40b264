"""Packing variable-length samples for one Megatron forward: two layouts, the same log-probs.

Glossary (shapes): a micro-batch holds B *samples* (prompt + response token ids, sample b
has n_b >= 1 tokens). Packed, they become `tokens` [R, L]: R rows of L positions, with
`segments[b] = (row, start, n_b)` saying where sample b sits. Per-position values come back
as [R, L] and `unpack` turns them into [B, T] per-sample values (T = max n_b).

Layouts (`PackedBatch.layout`), chosen by the model's attention (`packing_layout`):

- `"mask"` - megatron's local spec (CPU). Several samples per row (first-fit decreasing),
  L a multiple of `pad_multiple`. A block-diagonal causal mask [R, 1, L, L] confines
  attention to each sample; it is built per forward on the compute device from the segments
  (`block_causal_mask`) and never kept. RoPE runs over row positions and depends only on
  relative positions within a sample, so a sample's result does not depend on its offset.
- `"thd"` - TransformerEngine. One row [1, T_total]: the B samples in order, sample b padded
  to a multiple of `pad_multiple` and starting at `cu_seqlens_padded[b]`. The model gets
  `PackedSeqParams(qkv_format="thd")` with `cu_seqlens` (real lengths, what attention reads),
  `cu_seqlens_padded` (offsets in the row, what RoPE and TE's padding-aware kernels read) and
  `max_seqlen` (longest padded sequence: RoPE's table must cover it), and no attention mask.
  The TE spec's attention is `AttnMaskType.causal` and ignores `attention_mask`; megatron
  switches it to `padding_causal` for THD, so only this layout keeps samples apart under TE.
  RoPE restarts at position 0 for every sequence (megatron's `_apply_rotary_pos_emb_thd`
  / TE's fused THD RoPE split the row at `cu_seqlens_padded`).

`pad_multiple` is the tensor-parallel size under sequence parallelism (megatron splits the
sequence dimension of [S, B, H] over TP ranks, so S must divide by TP); with context
parallelism it must become TP x 2·CP (each CP rank takes two chunks of every sequence).
Under the allgather dispatcher, ranks that exchange tokens in MoE layers need the same shape
(`uniform_shape`): for THD that is the total padded length, the extra tail belonging to the
last sequence's padding. The alltoall dispatcher takes each rank's own shape.

Padding (token id 0, a real token of most vocabularies) is never a sample's token: attention
never sees it, no log-prob is read there, and `padding_mask` keeps it out of the MoE routers'
statistics (the load-balancing loss, expert-bias counts), so the extra padding a layout adds
(TP's multiple, EP peers' shapes) changes nothing.

Router token order (routing replay): hidden states are [S=L, B=R, H], so the router sees
token index `l * R + r`; under sequence parallelism TP rank i holds positions
[i L/tp, (i+1) L/tp). For THD (R = 1) the token index is the position in the row.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gspo.model.distributed import compute_device, expert_peers_need_equal_shapes

LAYOUTS = ("mask", "thd")


class PackingError(ValueError):
    """A packed batch does not fit the model or the requested shape."""


@dataclass
class PackedBatch:
    """Samples packed for one forward (see the module docstring for the layouts).

    Attributes:
        tokens: [R, L] token ids, 0 in padding (THD: R = 1, L = total padded length).
        labels: [R, L] next token of each position within its sample (0 where there is none).
        position_ids: [R, L] position of each token within its own sample (0 in padding).
        segments: per sample, (row, start, length), in the samples' original order.
        layout: "mask" (block-diagonal mask, local spec) or "thd" (PackedSeqParams, TE).
        pad_multiple: L (mask) or every sequence's padded length (THD) is a multiple of it.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    segments: list[tuple[int, int, int]]
    layout: str = "mask"
    pad_multiple: int = 1

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
        """Fraction of positions that hold no token."""
        used = sum(length for _, _, length in self.segments)
        return 1.0 - used / self.tokens.numel()

    def cu_seqlens(self) -> torch.Tensor:
        """THD: [B + 1] int32 cumulative real lengths (CPU)."""
        self._need_thd("cu_seqlens")
        lengths = torch.tensor([n for _, _, n in self.segments], dtype=torch.int32)
        return torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])

    def cu_seqlens_padded(self) -> torch.Tensor:
        """THD: [B + 1] int32 offsets of the sequences in the row, ending at L (CPU)."""
        self._need_thd("cu_seqlens_padded")
        starts = [start for _, start, _ in self.segments]
        return torch.tensor([*starts, self.tokens.shape[1]], dtype=torch.int32)

    def max_seqlen(self) -> int:
        """THD: the longest padded sequence (the tail padding counts to the last one)."""
        return int(self.cu_seqlens_padded().diff().max())

    def _need_thd(self, what: str) -> None:
        if self.layout != "thd":
            raise PackingError(f"{what} exists only for the thd layout, this batch is {self.layout!r}")


def packing_layout(model: torch.nn.Module) -> str:
    """The layout a model needs: "mask" for megatron's local attention, "thd" otherwise (TE).

    Megatron's local `DotProductAttention` honours any `attention_mask` and refuses
    `PackedSeqParams`; TransformerEngine's attention ignores the mask under the causal mask
    type, so a model with any other core attention must get THD.
    """
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    while hasattr(model, "module"):
        model = model.module
    if model in _LAYOUTS:  # asked on every forward; a built model's attention never changes
        return _LAYOUTS[model]
    cores = [m.core_attention for m in model.modules() if isinstance(m, Attention)]
    if not cores:
        raise PackingError(f"{type(model).__name__} has no megatron attention layer to pack for")
    _LAYOUTS[model] = "mask" if all(isinstance(c, DotProductAttention) for c in cores) else "thd"
    return _LAYOUTS[model]


_LAYOUTS: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def _place(
    seqs: list[torch.Tensor], segments: list[tuple[int, int, int]], rows: int, length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter the samples to their segments: (tokens, labels, position_ids) [rows, length].

    One scatter per tensor on the samples' device; only the index arithmetic runs on the host.
    """
    device = seqs[0].device
    flat = torch.cat(seqs)
    lengths = torch.tensor([n for _, _, n in segments])
    first = torch.cumsum(lengths, 0) - lengths  # index of each sample's first token in `flat`
    within = torch.arange(int(lengths.sum())) - first.repeat_interleave(lengths)
    base = torch.tensor([row * length + start for row, start, _ in segments])
    dest = (base.repeat_interleave(lengths) + within).to(device)
    has_next = (within < (lengths - 1).repeat_interleave(lengths)).nonzero().squeeze(1)
    tokens = flat.new_zeros(rows * length)
    labels = flat.new_zeros(rows * length)
    position_ids = flat.new_zeros(rows * length)
    tokens[dest] = flat
    position_ids[dest] = within.to(device)
    labels[dest[has_next.to(device)]] = flat[(has_next + 1).to(device)]
    shape = (rows, length)
    return tokens.view(shape), labels.view(shape), position_ids.view(shape)


def pack_sequences(
    sequences: list[torch.Tensor] | list[list[int]],
    *,
    layout: str = "mask",
    row_len: int | None = None,
    pad_multiple: int = 1,
    min_rows: int = 1,
) -> PackedBatch:
    """Pack B variable-length samples (on the device of the samples).

    Args:
        sequences: B samples, each a 1-D sequence of token ids (length >= 1).
        layout: "mask" (rows, first-fit decreasing) or "thd" (one row, samples in order).
        row_len: mask: capacity of a row; default the longest sample. Rounded up to `pad_multiple`.
        pad_multiple: mask: row length multiple; thd: every sequence's padded length multiple
            (TP size under sequence parallelism, x 2·CP with context parallelism).
        min_rows: mask: pad with empty rows up to this many (uniform shapes across ranks).

    Raises:
        PackingError: no samples, an empty sample, an unknown layout, or options of the mask
            layout given for thd.
    """
    if layout not in LAYOUTS:
        raise PackingError(f"packing layout must be one of {LAYOUTS}, got {layout!r}")
    if pad_multiple < 1:
        raise PackingError(f"pad_multiple must be >= 1, got {pad_multiple}")
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    if not seqs:
        raise PackingError("pack_sequences: no samples")
    lengths = [len(s) for s in seqs]
    if min(lengths) < 1:
        raise PackingError(f"pack_sequences: sample {lengths.index(0)} is empty")
    if layout == "thd" and (row_len is not None or min_rows != 1):
        raise PackingError("row_len / min_rows apply to the mask layout; thd packs one row")
    segments, rows, length = _arrange(lengths, layout, row_len or 0, pad_multiple)
    tokens, labels, position_ids = _place(seqs, segments, max(rows, min_rows), length)
    return PackedBatch(tokens, labels, position_ids, segments, layout, pad_multiple)


def _arrange(
    lengths: list[int], layout: str, row_len: int, pad_multiple: int
) -> tuple[list[tuple[int, int, int]], int, int]:
    """Where each sample of a layout goes: (segments, rows, row length); host arithmetic only."""
    if layout == "thd":
        padded = [-(-n // pad_multiple) * pad_multiple for n in lengths]
        starts = [0]
        for n in padded:
            starts.append(starts[-1] + n)
        return [(0, starts[b], n) for b, n in enumerate(lengths)], 1, starts[-1]
    capacity = max(row_len, max(lengths))
    capacity = -(-capacity // pad_multiple) * pad_multiple
    used: list[int] = []  # filled length per row
    segments = [(0, 0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        row = next((r for r, u in enumerate(used) if u + lengths[i] <= capacity), None)
        if row is None:
            used.append(0)
            row = len(used) - 1
        segments[i] = (row, used[row], lengths[i])
        used[row] += lengths[i]
    return segments, len(used), capacity


def packed_size(lengths: list[int], *, layout: str = "mask", pad_multiple: int = 1) -> int:
    """Positions (rows x row length) `pack_sequences` gives samples of these lengths (defaults).

    What a micro-batch costs before `uniform_shape` pads it to its expert-parallel peers' shape:
    THD the sum of the padded lengths; mask rows of the longest sample's length, first-fit.
    """
    _, rows, length = _arrange(lengths, layout, 0, pad_multiple)
    return rows * length


def pad_to_shape(packed: PackedBatch, rows: int, length: int) -> PackedBatch:
    """The same samples in a larger [rows, length] (empty rows / positions appended).

    For THD (rows = 1) the extra positions extend the last sequence's padding
    (`cu_seqlens_padded[-1]` is always L).
    """
    R, L = packed.tokens.shape
    if (rows, length) == (R, L):
        return packed
    if rows < R or length < L or length % packed.pad_multiple:
        raise PackingError(
            f"cannot pad a [{R}, {L}] batch to [{rows}, {length}] (pad_multiple {packed.pad_multiple})"
        )
    if packed.layout == "thd" and rows != 1:
        raise PackingError(f"a thd batch has one row, asked for {rows}")

    def grow(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros(rows, length)
        out[:R, :L] = t
        return out

    return PackedBatch(
        grow(packed.tokens),
        grow(packed.labels),
        grow(packed.position_ids),
        list(packed.segments),
        packed.layout,
        packed.pad_multiple,
    )


def uniform_shape(packed: PackedBatch) -> tuple[int, int]:
    """The (rows, row length) to pad a micro-batch to before the forward (collective or not).

    Expert-parallel ranks hold different data-parallel samples but exchange tokens in every
    MoE layer. The alltoall dispatcher takes any token count per rank: the batch keeps its
    own shape. The allgather dispatcher needs equal counts: the largest shape over the
    ranks exchanging tokens (collective). For THD the shape is (1, total padded length).
    """
    from megatron.core import parallel_state as ps

    rows, length = packed.tokens.shape
    group = ps.get_expert_tensor_and_model_parallel_group()
    if not expert_peers_need_equal_shapes() or group is None or dist.get_world_size(group) == 1:
        return rows, length
    shape = torch.tensor([rows, length], dtype=torch.long, device=compute_device())
    dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
    rows, length = shape.tolist()
    return rows, length


def block_causal_mask(packed: PackedBatch, device: torch.device | str) -> torch.Tensor:
    """[R, 1, L, L] bool, True = masked: position i sees j iff same sample and j <= i.

    Built on `device` from the segments (for THD: the real tokens of each padded sequence);
    padding positions see nothing. Used by the local spec, whose attention honours it.
    """
    R, L = packed.tokens.shape
    sample = torch.full((R * L,), -1, dtype=torch.long)
    for b, (row, start, n) in enumerate(packed.segments):
        sample[row * L + start : row * L + start + n] = b
    sample = sample.to(device).view(R, 1, L)
    position = torch.arange(L, device=device)
    visible = (sample.unsqueeze(-1) == sample.unsqueeze(-2)) & (sample.unsqueeze(-1) >= 0)
    visible &= position.view(L, 1) >= position.view(1, L)
    return ~visible


def padding_mask(packed: PackedBatch) -> torch.Tensor:
    """[R, L] bool on the CPU, True where no sample's token sits (megatron's MoE `padding_mask`).

    A sample's last token is one of its tokens (routed by its forward), though nothing follows it.
    """
    R, L = packed.tokens.shape
    real = torch.zeros(R * L, dtype=torch.bool)
    for row, start, n in packed.segments:
        real[row * L + start : row * L + start + n] = True
    return ~real.view(R, L)


def thd_params(packed: PackedBatch, device: torch.device | str):
    """Megatron `PackedSeqParams` of a THD batch, tensors on `device` (TE's kernels need CUDA)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = packed.cu_seqlens().to(device)
    cu_padded = packed.cu_seqlens_padded().to(device)
    max_len = packed.max_seqlen()
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )


def unpack(values: torch.Tensor, packed: PackedBatch, *, shift: bool = True) -> torch.Tensor:
    """[R, L] per-position values -> [B, T] per-sample values (right-padded with 0).

    With `shift`, a value computed at position t (about token t + 1) lands on token t + 1,
    so the result is aligned with the tokens (column 0 is 0). Keeps the autograd graph.
    """
    R, L = packed.tokens.shape
    T = packed.max_len
    rows, starts, lengths = torch.tensor(packed.segments, dtype=torch.int64).unbind(1)
    counts = lengths - 1 if shift else lengths
    first = torch.cumsum(counts, 0) - counts  # where each sample's values begin in the flat list
    within = torch.arange(int(counts.sum())) - torch.repeat_interleave(first, counts)
    src_index = (torch.repeat_interleave(rows * L + starts, counts) + within).to(values.device)
    samples = torch.arange(len(packed.segments))
    dst_index = (torch.repeat_interleave(samples * T + int(shift), counts) + within).to(values.device)
    out = values.new_zeros(packed.num_samples * T)
    out = out.index_copy(0, dst_index, values.reshape(-1).index_select(0, src_index))
    return out.view(packed.num_samples, T)
