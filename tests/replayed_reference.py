"""A teacher-forced reference pass of an HF MoE checkpoint that routes as the server did.

Decoding token by token (KV cache) and one teacher-forced forward differ by float noise
(~1e-6 in the router's probabilities). Where two experts' probabilities are that close, the two
passes can pick different experts, and the token's log-prob then differs by ~1e-2: a 480-token
generation hits such a near-tie about once in a hundred. Replaying the server's routed experts in
the reference pass removes that chance and keeps the comparison at float noise everywhere.
"""

import base64
import contextlib

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def routes_of(response, num_layers: int, topk: int) -> np.ndarray:
    """A response's routed experts [positions, L, k] (SGLang's base64 of int32)."""
    routed = np.frombuffer(base64.b64decode(response["meta_info"]["routed_experts"]), "<i4")
    return routed.reshape(-1, num_layers, topk)


@contextlib.contextmanager
def routes_replayed(model, routes: np.ndarray | None):
    """Within it, the MoE routers of `model` pick `routes` [rows, L, k] for the first rows tokens.

    A row of -1 is left to the router (e.g. a prefix whose routes the server did not return).

    Gating weights are the router's own probabilities at the replayed experts (renormalized
    when the model normalizes its top-k), as megatron's routing replay computes them.
    """
    if routes is None:
        yield
        return
    forced = torch.as_tensor(np.asarray(routes), dtype=torch.long)
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    assert len(routers) == forced.shape[1], (len(routers), forced.shape)

    def hook(layer):
        def replace(module, inputs, output):
            logits, _, indices = output
            indices = indices.clone()
            given = forced[:, layer]
            replay = (given >= 0).all(-1)
            indices[: given.shape[0]][replay] = given[replay]
            weights = torch.softmax(logits.float(), dim=-1).gather(1, indices)
            if module.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), indices

        return replace

    handles = [router.register_forward_hook(hook(i)) for i, router in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def teacher_forced(path, seq, *, temperature=1.0, routes=None):
    """log_softmax(logits / T) [len-1, V] and routing probabilities [len, L, E] of `seq`.

    With `routes` [len-1, L, k] (the server's routed experts of every position but the last),
    the pass routes as the server did; the probabilities are still the router's own.
    """
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with routes_replayed(model, routes):
        out = model(torch.tensor([seq]), output_router_logits=True)
    logprobs = torch.log_softmax(out.logits[0].float() / temperature, -1)[:-1]
    router = torch.softmax(torch.stack([r.float() for r in out.router_logits], dim=1), dim=-1)
    return logprobs, router
