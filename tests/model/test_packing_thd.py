"""The THD layout through megatron's packed-sequence path on CPU: PackedSeqParams reach attention,
RoPE restarts per sequence from cu_seqlens_padded, and R3 routing lands on the right tokens.

TransformerEngine does not install here, so each layer's core attention is swapped for
`ThdCausalAttention`, a plain-torch stand-in for TE's `padding_causal` THD kernel (it attends
within `cu_seqlens_q` of each sequence at `cu_seqlens_q_padded`). Everything around it is
megatron's own code on the THD path: the [T, 1, H] input, the squeeze to [t, heads, dim],
`apply_rotary_pos_emb` with `cu_seqlens`, the output reshape, SP-free MoE layers and the CE.
The GPU smoke suite runs the same comparison with TE's kernel.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.logprobs import packed_forward, sequence_logprobs
from megatron_gspo.model.packing import PackingError, pack_sequences, packing_layout, pad_to_shape, unpack
from megatron_gspo.model.routing import RoutingReplay, routing_from_rollout

CFG = tiny(vocab_size=64, init_std=0.2)


class ThdCausalAttention(torch.nn.Module):
    """Causal attention inside each THD sequence (TE's padding_causal), padding outputs 0."""

    def __init__(self, config):
        super().__init__()
        self.scale = config.kv_channels**-0.5
        self.calls = 0

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        assert attention_mask is None and packed_seq_params.qkv_format == "thd"
        assert query.dim() == 3  # [t, heads, dim]: megatron squeezed the batch dimension
        self.calls += 1
        cu = packed_seq_params.cu_seqlens_q.tolist()
        offsets = packed_seq_params.cu_seqlens_q_padded.tolist()
        groups = query.shape[1] // key.shape[1]
        out = query.new_zeros(query.shape)
        for b, start in enumerate(offsets[:-1]):
            span = slice(start, start + cu[b + 1] - cu[b])
            q = query[span].transpose(0, 1)
            k = key[span].repeat_interleave(groups, dim=1).transpose(0, 1)
            v = value[span].repeat_interleave(groups, dim=1).transpose(0, 1)
            out[span] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale).transpose(
                0, 1
            )
        return out.reshape(out.shape[0], -1)


def samples(n=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 30, (n,), generator=gen).tolist()
    return [torch.randint(3, CFG.vocab_size, (length,), generator=gen) for length in lengths]


@pytest.fixture(scope="module")
def models():
    """The same weights twice: megatron's local attention, and the THD stand-in."""
    init_distributed(ParallelConfig(), seed=3)
    local = build_model(CFG, ParallelConfig(), routing_replay=True).eval()
    thd = build_model(CFG, ParallelConfig(), routing_replay=True).eval()
    thd.load_state_dict(local.state_dict())
    for layer in thd.decoder.layers:
        layer.self_attention.core_attention = ThdCausalAttention(layer.config)
    yield local, thd
    destroy_distributed()


def test_layout_follows_the_attention_module(models):
    local, thd = models
    assert packing_layout(local) == "mask" and packing_layout(thd) == "thd"
    with pytest.raises(PackingError, match="ignores attention_mask"):
        packed_forward(thd, pack_sequences(samples(2)))


# One sequence: max_seqlen == cu_seqlens_padded[-1], megatron's RoPE takes its "exact offsets" branch.
@pytest.mark.parametrize("n,pad_multiple,total", [(9, 1, None), (9, 4, None), (9, 4, 420), (1, 4, None)])
def test_thd_through_megatron_packed_path_equals_one_sample_per_row(models, n, pad_multiple, total):
    """Also checks max_seqlen covers the longest padded sequence (RoPE's table would be short)."""
    local, thd = models
    seqs = samples(n, seed=2)
    packed = pack_sequences(seqs, layout="thd", pad_multiple=pad_multiple)
    if total is not None:
        packed = pad_to_shape(packed, 1, total)  # uniform shape: the last sequence's padding grows
    with torch.no_grad():
        one_per_row = [sequence_logprobs(local, [s])[0][0] for s in seqs]
        logprobs, _ = packed_forward(thd, packed)
    calls = [layer.self_attention.core_attention.calls for layer in thd.decoder.layers]
    assert all(c > 0 for c in calls)  # the THD params reached every layer's attention
    out = unpack(logprobs, packed)
    worst = max((out[b, : len(a)] - a).abs().max().item() for b, a in enumerate(one_per_row))
    print(
        f"\nthd via PackedSeqParams n={n} pad_multiple={pad_multiple} total={total}: max |diff| {worst:.2e}"
    )
    for b, alone in enumerate(one_per_row):
        torch.testing.assert_close(out[b, : len(alone)], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", ["packed_seq_params", "mask_fallback"])
def test_r3_routing_replays_on_the_right_thd_tokens(models, path):
    """Replayed per-sample routing in the THD row == the same routing replayed on each sample alone."""
    local, thd = models
    model = thd if path == "packed_seq_params" else local
    seqs = samples(5, seed=7)
    gen = torch.Generator().manual_seed(0)
    layers, k, experts = CFG.num_layers, CFG.moe_topk, CFG.num_experts
    routes = [torch.rand(len(s) - 1, layers, experts, generator=gen).argsort(-1)[..., :k] for s in seqs]
    packed = pad_to_shape(pack_sequences(seqs, layout="thd", pad_multiple=4), 1, 160)
    with RoutingReplay(model) as replay, torch.no_grad():
        with replay.replaying(routing_from_rollout(packed, routes, num_experts=experts)):
            together = unpack(packed_forward(model, packed)[0], packed)
        free = unpack(packed_forward(model, packed)[0], packed)
    with RoutingReplay(local) as replay, torch.no_grad():
        alone = []
        for seq, route in zip(seqs, routes):
            single = pack_sequences([seq])
            with replay.replaying(routing_from_rollout(single, [route], num_experts=experts)):
                alone.append(unpack(packed_forward(local, single)[0], single)[0])
    for b, ref in enumerate(alone):
        torch.testing.assert_close(together[b, : len(ref)], ref, atol=1e-5, rtol=0)
    assert (free - together).abs().max() > 1e-2  # the replayed routing really changed the result
