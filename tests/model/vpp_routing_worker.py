"""Routing record and replay under a virtual pipeline (PP2 x 2 chunks, interleaved 1F1B, recompute).

    torchrun --nproc_per_node=2 tests/model/vpp_routing_worker.py --out result

Each chunk gets its own `RoutingReplay` and hooks (`run_micro_batches(chunk_hooks=...)`), so
routing is keyed by (chunk, micro-batch). A no-grad pass records every (chunk, micro-batch)'s
routing; the routers are then perturbed heavily and a forward + backward replays the recording.
A forward hook on every router files what it actually used, in forwards and in backward
recomputes (`--wrong-chunk`: each chunk replays the other chunk's recording, which must show).
Every rank writes `<out>.rank<r>.json` with, per chunk and layer, whether each
micro-batch's forward and recompute used the recorded experts, a checksum of the recorded and of
the used routes, and how many tokens the perturbed routers would have sent elsewhere.
"""

import argparse
import hashlib
import json

import torch
import torch.distributed as dist

from megatron_gspo.model.builder import build_model
from megatron_gspo.model.chunks import model_chunks
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.engine import EngineConfig
from megatron_gspo.model.optim import wrap_ddp
from megatron_gspo.model.packing import pack_sequences
from megatron_gspo.model.pipeline import run_micro_batches
from megatron_gspo.model.routing import RoutingReplay, moe_routers, routing_map_to_indices
from megatron_gspo.model.routing_hooks import KeyedRecording, KeyedReplay

VOCAB, K, MICRO_BATCHES = 48, 2, 4


class UsedRouting:
    """What each router of one chunk used, per call: (in a backward recompute?, [tokens, k] ids)."""

    def __init__(self, chunk):
        self.events = [[] for _ in moe_routers(chunk)]
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(moe_routers(chunk))]

    def _hook(self, layer):
        def hook(module, inputs, output):
            recompute = torch._C._current_graph_task_id() != -1
            self.events[layer].append((recompute, routing_map_to_indices(output[1], K).cpu()))

        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def checksum(routes) -> str:
    """sha256 of [tokens, k] routes, experts sorted per token, in order."""
    digest = hashlib.sha256()
    for r in routes:
        digest.update(r.to(torch.int64).sort(dim=1).values.contiguous().numpy().tobytes())
    return digest.hexdigest()


def run(model, batches, *, forward_only, chunk_hooks):
    def loss(i, logprobs, _entropy):
        return logprobs.sum(), {}

    if forward_only:
        with torch.no_grad():
            run_micro_batches(model, batches, loss, forward_only=True, chunk_hooks=chunk_hooks)
    else:
        run_micro_batches(model, batches, loss, forward_only=False, chunk_hooks=chunk_hooks)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--wrong-chunk",
        action="store_true",
        help="replay each chunk with the other chunk's recording (a bug)",
    )
    args = parser.parse_args()
    parallel = ParallelConfig(pipeline_parallel=2, virtual_pipeline=2)
    init_distributed(parallel, seed=7)
    engine = EngineConfig(recompute_activations=True)
    model = wrap_ddp(
        build_model(tiny(vocab_size=VOCAB, num_layers=4, init_std=0.2), parallel, engine, routing_replay=True)
    )
    chunks = model_chunks(model)
    gen = torch.Generator().manual_seed(5)
    batches = [
        pack_sequences([torch.randint(3, VOCAB, (n + m,), generator=gen) for n in (7, 5, 9)])
        for m in range(MICRO_BATCHES)
    ]
    replays = [RoutingReplay(chunk) for chunk in chunks]
    recordings = [KeyedRecording(replay) for replay in replays]
    run(model, batches, forward_only=True, chunk_hooks=[[r] for r in recordings])
    with torch.no_grad():  # the policy moved a lot: left to themselves the routers pick other experts
        for router in moe_routers(model):
            router.weight.add_(
                10 * torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(9))
            )
    own = [UsedRouting(chunk) for chunk in chunks]
    run(model, batches, forward_only=True, chunk_hooks=())
    for u in own:
        u.close()
    used = [UsedRouting(chunk) for chunk in chunks]
    sources = recordings[::-1] if args.wrong_chunk else recordings  # the bug: keyed by micro-batch only
    replay_hooks = [
        [KeyedReplay(replay, lambda i, rec=rec: rec.routing[i])] for replay, rec in zip(replays, sources)
    ]
    run(model, batches, forward_only=False, chunk_hooks=replay_hooks)
    for u in used:
        u.close()
    result = {"chunks": []}
    differs = 0
    for replay, rec, u, o in zip(replays, recordings, used, own):
        layers = []
        for j, layer in enumerate(replay.layer_numbers):
            recorded = [rec.routing[i].layers[j].to(torch.long) for i in range(MICRO_BATCHES)]
            forward = [r for b, r in u.events[j] if not b]
            recompute = [r for b, r in u.events[j] if b]
            differs += sum(
                int((a.sort(dim=1).values != t.sort(dim=1).values).any(dim=1).sum())
                for (_, a), t in zip(o.events[j], recorded)
            )
            layers.append(
                {
                    "layer": layer,
                    "forwards": len(forward),
                    "recomputes": len(recompute),
                    "forward_ok": [
                        torch.equal(a.sort(dim=1).values, t.sort(dim=1).values)
                        for a, t in zip(forward, recorded)
                    ],
                    "recompute_ok": [
                        torch.equal(a.sort(dim=1).values, t.sort(dim=1).values)
                        for a, t in zip(recompute, recorded)
                    ],
                    "recorded_checksum": checksum(recorded),
                    "forward_checksum": checksum(forward),
                    "recompute_checksum": checksum(recompute),
                }
            )
        result["chunks"].append(layers)
        replay.close()
    result["own_routing_differs"] = differs
    with open(f"{args.out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
