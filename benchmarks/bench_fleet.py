"""Rollout tokens/s through SGLang's router vs the direct client, over the same two servers.

    OMP_NUM_THREADS=1 python benchmarks/bench_fleet.py [--quick]

Two embedded servers on the tiny MoE checkpoint, SGLang's real router (pip `sglang-router`,
cache-aware policy) in front of them. One rollout batch (groups of G=8 responses to one prompt,
`max_new_tokens` sampled tokens each, EOS ignored) is sent alternately: by the direct client
(one batched /generate per server, `rollout.server_urls`), through the router (one request
per row, `rollout.router_url`), and by the direct client one request per row (what the router's
own hop costs). Reports completion tokens/s of each and router / direct.

Group placement: the two servers are started at different `weight_version`s, so every response
names the server that generated it. A group whose G rows all ran on one server is the case a
prefix cache serves best (SGLang prefills the shared prompt once); the embedded server has no
cache across requests, so this measures the router's placement, not cache savings.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.rollout import SGLangClient, build_generate_request
from megatron_gspo.rollout.router_launch import launch_router, router_available
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

GROUP = 8


def batch(tokenizer, groups: int, new_tokens: int) -> list[dict]:
    rows = []
    for g in range(groups):
        prompt = tokenizer.encode(f"{g * 37 % 100}+{g * 53 % 100}=")
        for j in range(GROUP):
            params = {
                "max_new_tokens": new_tokens,
                "temperature": 0.7,
                "ignore_eos": True,
                "sampling_seed": j,
            }
            rows.append(build_generate_request(prompt, params, rid=f"g{g}-r{j}"))
    return rows


def timed(client: SGLangClient, rows: list[dict], *, single: bool = False) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    responses = client.generate(rows) if single else client.generate_batched(rows)
    elapsed = time.perf_counter() - start
    return sum(r["meta_info"]["completion_tokens"] for r in responses) / elapsed, responses


def whole_groups(responses: list[dict]) -> float:
    """Fraction of groups whose G responses came from one server."""
    servers = [r["meta_info"]["weight_version"] for r in responses]
    groups = [servers[i : i + GROUP] for i in range(0, len(servers), GROUP)]
    return sum(len(Counter(g)) == 1 for g in groups) / len(groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small batch and 2 rounds (CI)")
    args = parser.parse_args()
    if (reason := router_available()) is not None:
        raise SystemExit(reason)
    groups, new_tokens, rounds = (4, 8, 2) if args.quick else (16, 32, 3)
    tokenizer = build_char_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny_hf_checkpoint(Path(tmp) / "tiny", tiny(vocab_size=len(tokenizer)), tokenizer)
        with (
            launch_embedded_server(checkpoint, extra_args=["--weight-version", "server0"]) as a,
            launch_embedded_server(checkpoint, extra_args=["--weight-version", "server1"]) as b,
            launch_router([a.url, b.url]) as router,
            SGLangClient([a.url, b.url], max_concurrency=GROUP * groups) as direct,
            SGLangClient([], router_url=router.url, max_concurrency=GROUP * groups) as routed,
        ):
            rows = batch(tokenizer, groups, new_tokens)
            timed(direct, rows[:GROUP]), timed(routed, rows[:GROUP])  # warm-up
            direct_tps, routed_tps, placement, direct_placement, shares = [], [], [], [], Counter()
            single_tps = []
            for _ in range(rounds):
                single_tps.append(timed(direct, rows, single=True)[0])
                tps, responses = timed(direct, rows)
                direct_tps.append(tps)
                direct_placement.append(whole_groups(responses))
                tps, responses = timed(routed, rows)
                routed_tps.append(tps)
                placement.append(whole_groups(responses))
                shares.update(r["meta_info"]["weight_version"] for r in responses)
    d, r = statistics.median(direct_tps), statistics.median(routed_tps)
    print(f"batch: {groups} groups x {GROUP} responses x {new_tokens} tokens, 2 servers, {rounds} rounds")
    print(f"direct client (one batched /generate per server): {d:.0f} tokens/s")
    print(f"direct client, one request per row:               {statistics.median(single_tps):.0f} tokens/s")
    print(f"through the router (one request per row):          {r:.0f} tokens/s")
    print(f"router / direct: {r / d:.2f}")
    print(
        f"groups wholly on one server: through the router {statistics.mean(placement):.2f}, "
        f"direct {statistics.mean(direct_placement):.2f}"
    )
    total = sum(shares.values())
    print(
        "rows per server through the router: "
        + ", ".join(f"{k} {v / total:.2f}" for k, v in sorted(shares.items()))
    )


if __name__ == "__main__":
    main()
