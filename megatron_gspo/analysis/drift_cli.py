"""`megatron-gspo drift` (also `tools/expert_drift.py`): drift tables and plots for a report.

megatron-gspo drift --a CKPT_A --b CKPT_B --task addition --out report/
megatron-gspo drift --a RUN_DIR --b HF_DIR --task math_jsonl --task-option path=gsm8k.jsonl \
    --task-option prompt_key=question --out report/
megatron-gspo drift --a CKPT_A --b CKPT_B --config RUN/config.yaml --out report/   (the run's task)
megatron-gspo drift --a CKPT --dump rollouts.jsonl --out report/
megatron-gspo drift --metrics runs/x/metrics.jsonl --a CKPT_A --b CKPT_B --out report/

CKPT: an HF directory, a training checkpoint or a run directory (`checkpoint/source.py`).
Prompts (with --b): see `analysis/tool_prompts.py` (chat template and BOS as the trainer's).
"""

from __future__ import annotations

import argparse
import contextlib
import json

from megatron_gspo.analysis.tool_prompts import add_prompt_args, prompt_source
from megatron_gspo.checkpoint.source import hf_checkpoint_dir
from megatron_gspo.config import ConfigError


def add_drift_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megatron-gspo drift`."""
    parser.add_argument(
        "--a",
        required=True,
        help="reference checkpoint (old policy / trainer): HF dir, training checkpoint or run dir",
    )
    parser.add_argument("--b", help="second checkpoint (new policy): HF dir, training checkpoint or run dir")
    parser.add_argument("--dump", help="rollout dump (JSON lines with tokens, prompt_length, routed_experts)")
    add_prompt_args(parser, default_num_prompts=32)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--metrics", help="metrics.jsonl of a run: also plot drift over steps")
    parser.add_argument("--out", required=True, help="output directory")


def run_drift(args: argparse.Namespace) -> int:
    """Entry point: compute, plot, summarise; prints the summary JSON."""
    from transformers import AutoTokenizer

    from megatron_gspo.analysis.drift_report import (
        check_same_routing,
        compare,
        greedy_samples,
        load_dump,
        load_hf,
        write_report,
    )

    if (args.b is None) == (args.dump is None):
        raise ConfigError("drift: give exactly one of --b (second checkpoint) or --dump (rollout dump)")
    if args.metrics:  # before any model loads
        from megatron_gspo.analysis.drift_report import drift_metric_keys

        try:
            drift_metric_keys(args.metrics)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    prompts = prompt_source(args) if args.b else None  # bad prompt options fail before any export
    try:
        dump = load_dump(args.dump) if args.dump else None  # before any export or model load
    except (OSError, ValueError) as err:
        raise ConfigError(f"--dump: {err}") from None
    with contextlib.ExitStack() as stack:  # training checkpoints are exported to HF first
        dir_a = stack.enter_context(hf_checkpoint_dir(args.a, "--a"))
        model_a = load_hf(dir_a)
        against = "--dump" if dump is not None else "--b"
        try:  # checkpoints or a dump that cannot be compared, named
            if dump is not None:
                report = compare(model_a, dump, label="inference (dump) -> checkpoint")
            else:
                model_b = load_hf(stack.enter_context(hf_checkpoint_dir(args.b, "--b")))
                check_same_routing(model_a, model_b)
        except ValueError as err:
            raise ConfigError(f"drift --a {args.a} {against}: {err}") from None
        if dump is None:
            tokenizer = AutoTokenizer.from_pretrained(dir_a)
            samples = greedy_samples(model_a, prompts.encode(tokenizer), args.max_new_tokens)
            report = compare(model_a, samples, model_b=model_b, label="checkpoint a -> b")
    summary = write_report(report, args.out, metrics=args.metrics)
    print(json.dumps(summary, indent=2))
    return 0
