"""`megatron-gspo drift` (also `tools/expert_drift.py`): drift tables and plots for a report.

megatron-gspo drift --a CKPT_A --b CKPT_B --task addition --out report/
megatron-gspo drift --a CKPT --dump rollouts.jsonl --out report/
megatron-gspo drift --metrics runs/x/metrics.jsonl --a CKPT_A --b CKPT_B --out report/
"""

from __future__ import annotations

import argparse
import contextlib
import json

from megatron_gspo.config import ConfigError
from megatron_gspo.training.export import hf_directory


def add_drift_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megatron-gspo drift`."""
    parser.add_argument(
        "--a",
        required=True,
        help="reference checkpoint (old policy / trainer): HF dir or training checkpoint",
    )
    parser.add_argument("--b", help="second checkpoint (new policy): HF dir or training checkpoint")
    parser.add_argument("--dump", help="rollout dump (JSON lines with tokens, prompt_length, routed_experts)")
    parser.add_argument("--prompts", help="text file, one prompt per line (with --b)")
    parser.add_argument("--task", default="addition", help="task whose held-out prompts are used (with --b)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--metrics", help="metrics.jsonl of a run: also plot drift over steps")
    parser.add_argument("--out", required=True, help="output directory")


def _prompts(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    if args.prompts:
        with open(args.prompts) as f:
            texts = [line.rstrip("\n") for line in f if line.strip()]
    else:
        from megatron_gspo.tasks import get_task

        texts = [p.prompt for p in get_task(args.task).heldout(args.num_prompts)]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + tokenizer.encode(t, add_special_tokens=False) for t in texts[: args.num_prompts]]


def run_drift(args: argparse.Namespace) -> int:
    """Entry point: compute, plot, summarise; prints the summary JSON."""
    from transformers import AutoTokenizer

    from megatron_gspo.analysis.drift_report import compare, greedy_samples, load_dump, load_hf, write_report

    if (args.b is None) == (args.dump is None):
        raise SystemExit("drift: give exactly one of --b (second checkpoint) or --dump (rollout dump)")
    if args.metrics:  # before any model loads
        from megatron_gspo.analysis.drift_report import drift_metric_keys

        try:
            drift_metric_keys(args.metrics)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    with contextlib.ExitStack() as stack:  # training checkpoints are exported to HF first
        dir_a = stack.enter_context(hf_directory(args.a))
        model_a = load_hf(dir_a)
        if args.dump:
            report = compare(model_a, load_dump(args.dump), label="inference (dump) -> checkpoint")
        else:
            tokenizer = AutoTokenizer.from_pretrained(dir_a)
            samples = greedy_samples(model_a, _prompts(args, tokenizer), args.max_new_tokens)
            model_b = load_hf(stack.enter_context(hf_directory(args.b)))
            report = compare(model_a, samples, model_b=model_b, label="checkpoint a -> b")
    summary = write_report(report, args.out, metrics=args.metrics)
    print(json.dumps(summary, indent=2))
    return 0
