"""The reference pass that routes as a server did (`replayed_reference`) replays what it is given."""

import torch
from replayed_reference import teacher_forced

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

CFG = tiny(vocab_size=len(build_char_tokenizer()), init_std=0.2)
SEQ = [(7 * i) % 40 for i in range(24)]


def test_replaying_a_pass_own_routes_changes_nothing_and_another_expert_changes_its_token(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", CFG, seed=0)
    logprobs, router = teacher_forced(path, SEQ)
    own = router[:-1].topk(CFG.moe_topk, dim=-1).indices.numpy()
    replayed, replayed_router = teacher_forced(path, SEQ, routes=own)
    torch.testing.assert_close(replayed, logprobs, rtol=0, atol=1e-6)
    torch.testing.assert_close(replayed_router, router, rtol=0, atol=0)  # the router's own probabilities

    flipped = own.copy()
    t, last = 10, CFG.num_layers - 1
    worst = router[t, last].argsort()[0].item()  # the least likely expert, surely not routed to
    flipped[t, last, 0] = worst
    moved, _ = teacher_forced(path, SEQ, routes=flipped)
    assert (moved[:t] - logprobs[:t]).abs().max() < 1e-6  # causal: earlier tokens untouched
    assert (moved[t] - logprobs[t]).abs().max() > 1e-3  # the token whose last layer took another expert
    # The last layer's output at t feeds no later position: the later tokens are untouched too.
    assert (moved[t + 1 :] - logprobs[t + 1 :]).abs().max() < 1e-6
    flipped[t] = -1  # a row of -1 is the router's own choice
    left, _ = teacher_forced(path, SEQ, routes=flipped)
    torch.testing.assert_close(left, logprobs, rtol=0, atol=1e-6)
