"""Per-token log-probs from vocab-parallel logits vs a plain log_softmax reference; packing invariance."""

import pytest
import torch

from megatron_gspo.model.logprobs import pack_sequences, packed_forward, sequence_logprobs, unpack


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
    visible = ~packed.attention_mask[0, 0]
    assert visible[5].tolist() == [False, False, False, False, True, True]  # no attention across samples
    assert visible[3].tolist() == [True, True, True, True, False, False]
    assert packed.padding_fraction == pytest.approx(3 / 12)


def test_pack_rejects_empty_samples():
    with pytest.raises(ValueError, match="sample 1 is empty"):
        pack_sequences([[1, 2], []])
    with pytest.raises(ValueError, match="no samples"):
        pack_sequences([])


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
    for b, alone in enumerate(one_per_row):
        torch.testing.assert_close(packed[b, : len(alone)], alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(reordered[order.index(b), : len(alone)], alone, atol=1e-5, rtol=0)


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
