"""Per-token log-probs from vocab-parallel logits vs a plain log_softmax reference; packing invariance
for both layouts on the local spec (THD through its mask fallback; test_packing_thd.py runs THD
through megatron's packed-sequence attention path)."""

import dataclasses

import pytest
import torch

from megatron_gspo.model.logprobs import packed_forward, sequence_logprobs
from megatron_gspo.model.packing import (
    PackedBatch,
    PackingError,
    block_causal_mask,
    pack_sequences,
    packing_layout,
    pad_to_shape,
    thd_params,
    uniform_shape,
    unpack,
)


def samples(n=7, seed=0, vocab=64):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 30, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (length,), generator=gen) for length in lengths]


def reference_logprobs(model, seq, temperature=1.0):
    """Each sample alone, unpacked, full logits -> log_softmax -> gather (float64)."""
    n = len(seq)
    mask = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
    logits = model(seq[None], torch.arange(n)[None], mask)[0].double() / temperature
    logprobs = torch.log_softmax(logits, -1)
    token_logprobs = logprobs[:-1].gather(-1, seq[1:, None]).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)[:-1]
    return token_logprobs, entropy


def test_pack_sequences_layout():
    packed = pack_sequences([[5, 6, 7], [8, 9], [10, 11, 12, 13]], row_len=6)
    assert packed.tokens.shape == (2, 6)
    # first-fit decreasing: the 4-token sample opens row 0, the 3-token one row 1, the 2-token joins row 0
    assert packed.segments == [(1, 0, 3), (0, 4, 2), (0, 0, 4)]
    assert packed.tokens[0].tolist() == [10, 11, 12, 13, 8, 9]
    assert packed.labels[0].tolist() == [11, 12, 13, 0, 9, 0]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1]
    visible = ~block_causal_mask(packed, "cpu")[0, 0]
    assert visible[5].tolist() == [False, False, False, False, True, True]  # no attention across samples
    assert visible[3].tolist() == [True, True, True, True, False, False]
    assert packed.padding_fraction == pytest.approx(3 / 12)


def test_thd_layout_by_hand():
    packed = pack_sequences([[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]], layout="thd", pad_multiple=4)
    assert packed.layout == "thd" and packed.tokens.shape == (1, 16)
    # samples in order, each padded to a multiple of 4: offsets 0, 4, 8 and the row ends at 16
    assert packed.segments == [(0, 0, 3), (0, 4, 2), (0, 8, 5)]
    assert packed.tokens[0].tolist() == [5, 6, 7, 0, 8, 9, 0, 0, 10, 11, 12, 13, 14, 0, 0, 0]
    assert packed.labels[0].tolist() == [6, 7, 0, 0, 9, 0, 0, 0, 11, 12, 13, 14, 0, 0, 0, 0]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 0, 0, 1, 0, 0, 0, 1, 2, 3, 4, 0, 0, 0]
    assert packed.cu_seqlens().tolist() == [0, 3, 5, 10]
    assert packed.cu_seqlens_padded().tolist() == [0, 4, 8, 16]
    assert packed.max_seqlen() == 8
    params = thd_params(packed, "cpu")
    assert params.qkv_format == "thd" and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 3, 5, 10]
    assert params.cu_seqlens_q_padded.tolist() == params.cu_seqlens_kv_padded.tolist() == [0, 4, 8, 16]
    assert params.max_seqlen_q == params.max_seqlen_kv == 8
    # a uniform shape across ranks extends the last sequence's padding
    wider = pad_to_shape(packed, 1, 24)
    assert wider.cu_seqlens_padded().tolist() == [0, 4, 8, 24] and wider.max_seqlen() == 16
    assert wider.cu_seqlens().tolist() == [0, 3, 5, 10] and wider.tokens[0, 16:].eq(0).all()
    # the mask fallback of a THD row (local spec) confines attention to each real sequence
    visible = ~block_causal_mask(packed, "cpu")[0, 0]
    assert visible[5].tolist() == [False] * 4 + [True, True] + [False] * 10
    assert not visible[3].any() and not visible[13].any()  # padding sees nothing


def test_pack_rejects_bad_input():
    with pytest.raises(PackingError, match="sample 1 is empty"):
        pack_sequences([[1, 2], []])
    with pytest.raises(PackingError, match="no samples"):
        pack_sequences([])
    with pytest.raises(PackingError, match="layout must be one of"):
        pack_sequences([[1, 2]], layout="bshd")
    with pytest.raises(PackingError, match="row_len / min_rows apply to the mask layout"):
        pack_sequences([[1, 2]], layout="thd", row_len=8)
    with pytest.raises(PackingError, match="cannot pad a \\[1, 4\\] batch to \\[1, 6\\]"):
        pad_to_shape(pack_sequences([[1, 2]], layout="thd", pad_multiple=4), 1, 6)
    with pytest.raises(PackingError, match="a thd batch has one row"):
        pad_to_shape(pack_sequences([[1, 2]], layout="thd"), 2, 2)
    with pytest.raises(PackingError, match="only for the thd layout"):
        pack_sequences([[1, 2]]).cu_seqlens()


def test_packed_batch_keeps_no_attention_mask():
    fields = {f.name for f in dataclasses.fields(PackedBatch)}
    assert fields == {"tokens", "labels", "position_ids", "segments", "layout", "pad_multiple"}
    for layout in ("mask", "thd"):
        packed = pack_sequences(samples(), layout=layout, pad_multiple=2)
        tensors = [v for v in vars(packed).values() if torch.is_tensor(v)]
        assert all(t.shape == packed.tokens.shape for t in tensors)  # nothing [L, L]-sized is kept


def test_mask_built_per_forward_on_the_model_device(world_one_model):
    device = next(world_one_model.parameters()).device
    seen = []

    def record(module, args, kwargs):
        seen.append((kwargs.get("attention_mask"), kwargs.get("packed_seq_params")))

    handle = world_one_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            for layout in ("mask", "thd", "mask"):
                packed_forward(world_one_model, pack_sequences(samples(3), layout=layout))
    finally:
        handle.remove()
    assert [params for _, params in seen] == [None, None, None]  # the local spec refuses THD params
    masks = [mask for mask, _ in seen]
    assert all(m.device == device and m.dtype == torch.bool and m.shape[1] == 1 for m in masks)
    assert masks[0] is not masks[2]  # a new mask for every forward, none kept


def test_uniform_shape_is_the_batch_shape_in_a_world_of_one(world_one_model):
    for layout in ("mask", "thd"):
        packed = pack_sequences(samples(), layout=layout, pad_multiple=4)
        assert uniform_shape(packed) == tuple(packed.tokens.shape)


def test_packing_layout_of_the_local_spec(world_one_model):
    assert packing_layout(world_one_model) == "mask"
    with pytest.raises(PackingError, match="no megatron attention"):
        packing_layout(torch.nn.Linear(2, 2))


def test_unpack_aligns_values_with_tokens():
    packed = pack_sequences([[5, 6, 7], [8, 9]], row_len=5)
    values = torch.arange(10, dtype=torch.float).view(2, 5)
    shifted = unpack(values, packed)
    assert shifted.tolist() == [[0.0, 0.0, 1.0], [0.0, 3.0, 0.0]]
    assert unpack(values, packed, shift=False).tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]


def test_logprobs_and_entropy_equal_log_softmax_reference(world_one_model):
    seqs = samples()
    with torch.no_grad():
        logprobs, entropy = sequence_logprobs(world_one_model, seqs, with_entropy=True)
        for b, seq in enumerate(seqs):
            ref_lp, ref_entropy = reference_logprobs(world_one_model, seq)
            n = len(seq)
            assert logprobs[b, 0] == 0
            torch.testing.assert_close(logprobs[b, 1:n].double(), ref_lp, atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy[b, 1:n].double(), ref_entropy, atol=1e-5, rtol=0)
            assert (logprobs[b, n:] == 0).all()
    assert logprobs.min() < -1.0  # sharp init: not a uniform distribution


def test_temperature_divides_logits_first(world_one_model):
    seqs = samples(3, seed=1)
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(world_one_model, seqs, temperature=0.7)
        plain, _ = sequence_logprobs(world_one_model, seqs)
        for b, seq in enumerate(seqs):
            ref, _ = reference_logprobs(world_one_model, seq, temperature=0.7)
            torch.testing.assert_close(logprobs[b, 1 : len(seq)].double(), ref, atol=1e-5, rtol=0)
    assert (logprobs - plain).abs().max() > 1e-2
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sequence_logprobs(world_one_model, seqs, temperature=0.0)


@pytest.mark.parametrize("row_len,pad_multiple", [(None, 1), (64, 1), (200, 8), (31, 4)])
def test_logprobs_do_not_depend_on_packing_or_padding(world_one_model, row_len, pad_multiple):
    seqs = samples(9, seed=2)
    with torch.no_grad():
        one_per_row = [sequence_logprobs(world_one_model, [s])[0][0] for s in seqs]
        packed, _ = sequence_logprobs(world_one_model, seqs, row_len=row_len, pad_multiple=pad_multiple)
        order = list(reversed(range(len(seqs))))
        reordered, _ = sequence_logprobs(world_one_model, [seqs[i] for i in order], row_len=row_len)
    assert pack_sequences(seqs, row_len=row_len).tokens.shape[0] < len(seqs)  # rows are shared
    worst = max((packed[b, : len(a)] - a).abs().max().item() for b, a in enumerate(one_per_row))
    print(f"\nmask layout row_len={row_len} pad_multiple={pad_multiple}: max |packed - alone| {worst:.2e}")
    for b, alone in enumerate(one_per_row):
        torch.testing.assert_close(packed[b, : len(alone)], alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(reordered[order.index(b), : len(alone)], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pad_multiple,total", [(1, None), (4, None), (8, 400)])
def test_thd_row_on_the_local_spec_equals_one_sample_per_row(world_one_model, pad_multiple, total):
    """The THD data path (one row, per-sequence padding, tail padding, unpacking) on CPU."""
    seqs = samples(9, seed=2)
    packed = pack_sequences(seqs, layout="thd", pad_multiple=pad_multiple)
    if total is not None:
        packed = pad_to_shape(packed, 1, total)
    with torch.no_grad():
        one_per_row = [sequence_logprobs(world_one_model, [s], layout="mask")[0][0] for s in seqs]
        logprobs, entropy = packed_forward(world_one_model, packed, with_entropy=True)
        thd, thd_entropy = unpack(logprobs, packed), unpack(entropy, packed)
        _, mask_entropy = sequence_logprobs(world_one_model, seqs, with_entropy=True)
    worst = max((thd[b, : len(a)] - a).abs().max().item() for b, a in enumerate(one_per_row))
    print(f"\nthd layout (mask fallback) pad_multiple={pad_multiple}: max |packed - alone| {worst:.2e}")
    for b, alone in enumerate(one_per_row):
        torch.testing.assert_close(thd[b, : len(alone)], alone, atol=1e-5, rtol=0)
        assert (thd[b, len(alone) :] == 0).all()
    torch.testing.assert_close(thd_entropy, mask_entropy, atol=1e-5, rtol=0)


def test_gradients_flow_through_packed_logprobs(world_one_model):
    seqs = samples(4, seed=3)
    packed = pack_sequences(seqs, row_len=64)
    logprobs, _ = packed_forward(world_one_model, packed)
    world_one_model.zero_grad(set_to_none=True)
    unpack(logprobs, packed).sum().backward()
    grads = {n: p.grad for n, p in world_one_model.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert grads["output_layer.weight"].abs().sum() > 0
    world_one_model.zero_grad(set_to_none=True)
