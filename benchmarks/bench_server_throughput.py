"""Completion tokens per second: the embedded rollout server over HTTP vs `transformers` `generate`.

    OMP_NUM_THREADS=1 python benchmarks/bench_server_throughput.py [--quick]

The demo's tiny MoE (random init, exported as an HF checkpoint) answers one batch of demo
prompts with `max_new_tokens` sampled tokens each (EOS ignored, so both sides generate the same
number of tokens): once through the embedded SGLang-protocol server, as the rollouts ask for
them (one batched `/generate` with log-probs, temperature 0.7), once through
`AutoModelForCausalLM.generate` on the same checkpoint in this process (left-padded batch, no
log-probs), alternately. Both run one torch thread. Reports tokens/s of each and server /
generate (goal >= 0.5).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def export_demo_model(out_dir: Path):
    """The demo config's policy at its init, written as an HF checkpoint; returns (config, tokenizer)."""
    from megatron_gspo.config import build_model_config, load_config
    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
    from megatron_gspo.model.hf.export import export_hf_checkpoint
    from megatron_gspo.tasks.tokenizer import build_char_tokenizer

    cfg = load_config(REPO / "configs" / "tiny_moe_cpu.yaml")
    tokenizer = build_char_tokenizer()
    init_distributed(ParallelConfig(), seed=cfg.trainer.seed)
    try:
        model_cfg = build_model_config(cfg)
        export_hf_checkpoint(build_model(model_cfg, cfg.parallel), out_dir, model_cfg, tokenizer)
    finally:
        destroy_distributed()
    return cfg, tokenizer


def demo_prompts(cfg, tokenizer, count: int) -> list[list[int]]:
    from megatron_gspo.config import build_task
    from megatron_gspo.tasks import PromptStream
    from megatron_gspo.tasks.tokenizer import encode_prompt, resolve_add_bos

    problems = PromptStream(build_task(cfg), count, seed=0).next_batch()
    return [
        encode_prompt(tokenizer, p.prompt, add_bos=resolve_add_bos(cfg.task.add_bos, tokenizer))
        for p in problems
    ]


def server_call(client, prompts, new_tokens: int, temperature: float):
    """One batched `/generate` of `prompts` through the server; returns the completion tokens."""
    from megatron_gspo.rollout.requests import build_generate_request

    params = {"max_new_tokens": new_tokens, "temperature": temperature, "ignore_eos": True}
    bodies = [build_generate_request(p, params, rid=f"bench-{i}") for i, p in enumerate(prompts)]
    return lambda: sum(len(r["output_ids"]) for r in client.generate_batched(bodies))


def generate_call(model_dir: Path, prompts, new_tokens: int, temperature: float):
    """One left-padded `generate` of `prompts` by transformers; returns the completion tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=True, temperature=temperature, top_k=0, pad_token_id=pad)  # fmt: skip

    @torch.no_grad()
    def call() -> int:
        return (model.generate(ids, **kwargs).shape[1] - width) * len(prompts)

    return call


def alternate(calls: dict, repeats: int) -> dict[str, list[float]]:
    """Tokens/s of each call (returning its completion tokens), one warm-up, then one of each per repeat."""
    for call in calls.values():
        call()  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            tokens = call()
            rates[name].append(tokens / (time.perf_counter() - start))
    return rates


def measure(quick: bool = False) -> dict[str, float]:
    """Tokens/s of the server and of `generate` on the same batch, and their ratio.

    The two run alternately, one call each per repeat, and the ratio is the median of the
    per-repeat ratios, so that load from other work on the machine cancels out.
    """
    from megatron_gspo.rollout.client import SGLangClient
    from megatron_gspo.rollout.server.launch import launch_embedded_server

    batch, new_tokens, repeats = (16, 8, 2) if quick else (64, 32, 7)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = Path(tmp, "policy")
            cfg, tokenizer = export_demo_model(model_dir)
            prompts = demo_prompts(cfg, tokenizer, batch)
            temperature = cfg.rollout.temperature
            with (
                launch_embedded_server(model_dir, num_threads=1) as server,
                SGLangClient([server.url]) as client,
            ):
                client.wait_until_healthy(120)
                calls = {
                    "server": server_call(client, prompts, new_tokens, temperature),
                    "generate": generate_call(model_dir, prompts, new_tokens, temperature),
                }
                rates = alternate(calls, repeats)
    finally:
        torch.set_num_threads(threads)
    return {
        "server_tokens_per_s": statistics.median(rates["server"]),
        "generate_tokens_per_s": statistics.median(rates["generate"]),
        "server_vs_generate": statistics.median(a / b for a, b in zip(rates["server"], rates["generate"])),
        "batch": float(batch),
        "new_tokens": float(new_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 prompts x 8 tokens instead of 64 x 32")
    for key, value in measure(parser.parse_args().quick).items():
        print(f"{key:24s} {value:10.2f}")


if __name__ == "__main__":
    main()
