"""Rank 0's response validation cost: milliseconds per million tokens, before / after vectorising.

    python benchmarks/bench_validation.py [--responses 64 --response-len 4096 --with-routing]

Synthetic SGLang `/generate` responses (already-decoded JSON bodies, as the client hands them
over) of `--response-len` tokens each after a 512-token prompt, optionally with routed experts
of a Qwen3-30B-A3B-shaped model (48 layers x top-8 of 128, base64 int32). `before` is the
per-token Python validation as of commit c5dd7bd (read from git history, not kept in the
package); `after` is today's `parse_generate_response`. Both must accept every response; the
ratio is measured in one run.
"""

import argparse
import base64
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from megatron_gspo.rollout import validation

BEFORE_COMMIT = "c5dd7bd"
LAYERS, TOPK, EXPERTS, VOCAB, PROMPT = 48, 8, 128, 151_936, 512


def old_validation():
    """The validation module as of `BEFORE_COMMIT`, imported from a temporary file."""
    repo = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "show", f"{BEFORE_COMMIT}:megatron_gspo/rollout/validation.py"],
        cwd=repo, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "validation_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("validation_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def synthetic_response(rng: random.Random, length: int, routing: bool) -> tuple[list[int], dict]:
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT)]
    output = [rng.randrange(VOCAB) for _ in range(length)]
    meta = {
        "id": f"r{rng.random()}",
        "finish_reason": {"type": "length", "length": length},
        "prompt_tokens": PROMPT,
        "completion_tokens": length,
        "cached_tokens": 0,
        "output_token_logprobs": [[-rng.random() * 3, t, None] for t in output],
    }
    if routing:
        ids = np.argsort(
            np.random.default_rng(rng.randrange(2**31)).random((PROMPT + length - 1, LAYERS, EXPERTS))
        )
        meta["routed_experts"] = base64.b64encode(ids[..., :TOPK].astype("<i4").tobytes()).decode()
    return prompt, {"text": "", "output_ids": output, "meta_info": meta}


def time_module(module, responses, routing: bool) -> float:
    kwargs = {"num_layers": LAYERS, "topk": TOPK, "num_experts": EXPERTS} if routing else {}
    start = time.perf_counter()
    for prompt, body in responses:
        module.parse_generate_response(
            prompt, body, vocab_size=VOCAB, expect_routed_experts=routing, **kwargs
        )
    return time.perf_counter() - start


def measure(
    quick: bool = False,
    *,
    responses: int | None = None,
    response_len: int | None = None,
    routing: bool = True,
) -> dict[str, float]:
    """Milliseconds per million tokens before / after, and their ratio (routed experts included)."""
    responses = responses or (4 if quick else 16)
    response_len = response_len or (512 if quick else 4096)
    rng = random.Random(0)
    bodies = [synthetic_response(rng, response_len, routing) for _ in range(responses)]
    tokens = responses * (PROMPT + response_len)
    before_module = old_validation()
    time_module(validation, bodies[:2], routing)  # warm-up
    before = time_module(before_module, bodies, routing)
    after = time_module(validation, bodies, routing)
    per_m = 1e6 / tokens * 1e3
    return {
        "before_ms_per_m_tokens": before * per_m,
        "after_ms_per_m_tokens": after * per_m,
        "after_vs_before": after / before,
        "tokens": float(tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--responses", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=4096)
    parser.add_argument("--with-routing", action="store_true", help="also decode 48x8 routed experts")
    args = parser.parse_args()
    r = measure(responses=args.responses, response_len=args.response_len, routing=args.with_routing)
    routing = ", routed experts 48x8" if args.with_routing else ""
    tokens = int(r["tokens"])
    print(
        f"{args.responses} responses x ({PROMPT} + {args.response_len}) tokens = {tokens:,} tokens{routing}"
    )
    print(f"before ({BEFORE_COMMIT}): {r['before_ms_per_m_tokens']:8.1f} ms per million tokens")
    print(f"after:            {r['after_ms_per_m_tokens']:8.1f} ms per million tokens")
    print(f"after / before:   {r['after_vs_before']:8.3f}")


if __name__ == "__main__":
    main()
