"""R3 alignment: the embedded SGLang-protocol server and the Megatron model hold the same weights.

Replaying the server's routed experts makes the trainer route every (token, layer) exactly as
the server did; without replay the trainer's own routing differs only at near-ties (this is
the inference -> training drift, printed with -s).
"""

import httpx
import pytest
import torch

from megatron_gspo.algorithms.drift import routing_drift
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.model.hf.convert import load_hf_checkpoint
from megatron_gspo.model.logprobs import pack_sequences, packed_forward
from megatron_gspo.model.routing import (
    RoutingCapture,
    RoutingReplay,
    moe_routers,
    routing_from_rollout,
    routing_token_mask,
)
from megatron_gspo.rollout.requests import build_generate_request
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.rollout.validation import parse_generate_response
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
CFG = tiny(vocab_size=len(TOKENIZER), init_std=0.2)
PROMPTS = ["12+34=", "7+8=", "sort 3 1 2:", "99+1=", "a", "5+5="]
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    ckpt = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("r3") / "ckpt", CFG, seed=0)
    samples = []
    with launch_embedded_server(ckpt) as server, httpx.Client(timeout=120) as client:
        for i, text in enumerate(PROMPTS):
            ids = TOKENIZER.encode(text)
            params = {"max_new_tokens": 10 + i, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True}
            body = build_generate_request(ids, params, return_routed_experts=True)
            reply = client.post(f"{server.url}/generate", json=body)
            assert reply.status_code == 200, reply.text
            samples.append(
                parse_generate_response(
                    ids,
                    reply.json(),
                    num_layers=CFG.num_layers,
                    topk=CFG.moe_topk,
                    num_experts=CFG.num_experts,
                    expect_routed_experts=True,
                )
            )
    return ckpt, samples


@pytest.fixture(scope="module")
def model(rollouts):
    init_distributed(ParallelConfig(), seed=0)
    gpt = build_model(CFG, ParallelConfig(), routing_replay=True)
    load_hf_checkpoint(gpt, rollouts[0], CFG)
    yield gpt
    destroy_distributed()


def _router_gaps(model):
    """Forward hooks: per layer, the gap between the k-th and (k+1)-th router probability."""
    gaps, handles = [], []
    for router in moe_routers(model):

        def hook(module, inputs, output, store=gaps):
            probs = torch.softmax(module.gating(inputs[0]).view(-1, CFG.num_experts).float(), -1)
            top = probs.topk(CFG.moe_topk + 1, dim=-1).values
            store.append(top[:, -2] - top[:, -1])

        handles.append(router.register_forward_hook(hook))
    return gaps, handles


def test_replayed_routing_equals_server_routing_and_free_routing_differs_only_at_near_ties(model, rollouts):
    _, samples = rollouts
    seqs = [torch.cat([s.prompt_ids, s.response_ids]) for s in samples]
    routed = [s.routed_experts for s in samples]
    packed = pack_sequences(seqs, row_len=32)
    assert packed.tokens.shape[0] < len(seqs)  # several samples share a row
    server = routing_from_rollout(packed, routed, num_experts=CFG.num_experts)
    mask = routing_token_mask(packed)
    expected = server.stacked().sort(-1).values

    with RoutingReplay(model) as replay:
        with replay.replaying(server), RoutingCapture(model) as capture, torch.no_grad():
            packed_forward(model, packed)
    replayed = capture.routing().stacked()
    assert torch.equal(replayed, expected)  # every (token, layer), padding filler included

    gaps, handles = _router_gaps(model)
    try:
        with RoutingCapture(model) as capture, torch.no_grad():
            packed_forward(model, packed)
    finally:
        for h in handles:
            h.remove()
    free = capture.routing().stacked()
    differs = (free != expected).any(-1) & mask[:, None]  # [tokens, layers]
    near_tie = torch.stack(gaps, dim=1) < NEAR_TIE
    assert not (differs & ~near_tie).any(), "trainer and server routing differ away from a near-tie"
    drift = routing_drift(expected, free, num_experts=CFG.num_experts, mask=mask)
    print(
        f"\ninference->training drift on identical weights: per layer {drift.per_layer.tolist()}, "
        f"tokens differing in >=1 layer {drift.tokens_changed:.4f} of {drift.num_tokens}"
    )
    assert drift.mean <= 0.02
