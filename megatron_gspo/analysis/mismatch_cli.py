"""Report files and command line of the log-prob mismatch tool (`megatron-gspo mismatch`).

megatron-gspo mismatch --checkpoint CKPT --temperatures 1.0 0.7 --out report/
megatron-gspo mismatch --checkpoint CKPT --original-logprob --ignore-eos --out report/
megatron-gspo mismatch --checkpoint CKPT --server-url http://gpu-node:30000 --prompts p.jsonl --out r/
megatron-gspo mismatch --checkpoint RUN_DIR --config RUN_DIR/config.yaml --out r/   (the run's task)

CKPT: an HF directory, a training checkpoint or a run directory (`checkpoint/source.py`);
prompts as `analysis/tool_prompts.py` says (chat template and BOS as the trainer's).

Outputs: summary.json (every number), summary.md (a table of comparisons and one by response
length per comparison, the latter also printed), mismatch_per_position.png (mean |diff| by
response position), ratio_spread.png (token vs sequence log-ratio histograms). See
megatron_gspo/analysis/logprob_mismatch.py for the method.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from megatron_gspo.analysis.logprob_mismatch import MismatchConfig, MismatchReport, run_mismatch
from megatron_gspo.analysis.tool_prompts import PromptSource, add_prompt_args, prompt_source
from megatron_gspo.checkpoint.source import hf_checkpoint_dir

# ----------------------------------------------------------------------------- report


def _plt():
    from megatron_gspo.optional import require

    matplotlib = require("matplotlib", "megatron-gspo mismatch's figures")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_per_position(summary: dict, path: Path) -> None:
    """Mean |diff| by position in the response, one line per comparison (log scale)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for row in summary["comparisons"]:
        values = [max(v, 1e-12) for v in row["per_position_abs_diff_mean"]]
        ax.plot(range(len(values)), values, marker=".", label=row["name"])
    ax.set_yscale("log")
    ax.set(
        xlabel="position in response", ylabel="mean |trainer - rollout| log-prob", title="Log-prob mismatch"
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_ratio_spread(report: MismatchReport, path: Path) -> None:
    """Per comparison: histograms of token log-ratios (GRPO) vs sequence log-ratios (GSPO)."""
    import numpy as np

    plt = _plt()
    n = len(report.comparisons)
    fig, axes = plt.subplots(n, 1, figsize=(6.5, 2.6 * n), squeeze=False)
    for ax, c in zip(axes[:, 0], report.comparisons):
        tokens, seqs = c.log_token_ratios().numpy(), c.log_seq_ratios().numpy()
        bins = np.histogram_bin_edges(np.concatenate([tokens, seqs]), bins=40)  # shared, so widths compare
        ax.hist(tokens, bins=bins, alpha=0.6, density=True, label="token (GRPO)")
        ax.hist(seqs, bins=bins, alpha=0.6, density=True, label="sequence mean (GSPO)")
        ax.set(xlabel="log(pi_train / pi_rollout)", ylabel="density", title=c.name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def by_length_tables(summary: dict) -> list[str]:
    """Markdown: per comparison, mean |diff|, k3 KL and mean sequence log-ratio by length bucket."""
    lines = []
    for r in summary["comparisons"]:
        lines += [
            f"### {r['name']}: by response length",
            "",
            "| length | seqs | tokens | mean abs | KL k3 | mean seq log r |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for b in r["by_length"]:
            cells = [b["abs_diff_mean"], b["kl_k3"], b["log_seq_ratio_mean"]]
            lines.append(
                f"| {b['bucket']} | {b['num_sequences']} | {b['num_tokens']} | "
                + " | ".join(map(_fmt, cells))
                + " |"
            )
        lines.append("")
    return lines


def write_report(report: MismatchReport, out_dir: str | os.PathLike) -> dict:
    """summary.json, summary.md and the two PNGs in `out_dir`; returns the summary dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = report.summary()
    plot_per_position(summary, out / "mismatch_per_position.png")
    plot_ratio_spread(report, out / "ratio_spread.png")
    summary["figures"] = ["mismatch_per_position.png", "ratio_spread.png"]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    low, high = report.config["token_clip"]
    seq_low, seq_high = report.config["seq_clip"]
    lines = [
        f"# Train/inference log-prob mismatch: {report.config['checkpoint']}",
        "",
        "log r = trainer (Megatron) - rollout (server) log-prob of the same token, same weights.",
        f"Token clip [{1 - low:g}, {1 + high:g}] (GRPO), "
        f"sequence clip [{1 - seq_low:g}, {1 + seq_high:g}] (GSPO).",
        "",
        "| comparison | seqs | tokens | mean abs | max abs | first token | rest | std log r (token) "
        "| std log r (seq) | token clip frac | seq clip frac | KL k3 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["comparisons"]:
        cells = [
            r["abs_diff_mean"],
            r["abs_diff_max"],
            r["first_token_abs_diff_mean"],
            r["rest_abs_diff_mean"],
        ]
        cells += [r["log_token_ratio_std"], r["log_seq_ratio_std"], r["token_clip_fraction"]]
        cells += [r["seq_clip_fraction"], r["kl_k3"]]
        lines.append(
            f"| {r['name']} | {r['num_sequences']} | {r['num_tokens']} | "
            + " | ".join(map(_fmt, cells))
            + " |"
        )
    for t, gap in summary["mode_gap"].items():
        lines.append("")
        lines.append(
            f"Scaled vs original reported log-probs at T={t}: same tokens in "
            f"{gap['same_tokens_fraction']:.2f} of responses; |gap| mean "
            f"{_fmt(gap.get('abs_diff_mean'))}, max {_fmt(gap.get('abs_diff_max'))}."
        )
    lines += ["", "## By response length (buckets 1, 2-3, 4-7, ...)", "", *by_length_tables(summary)]
    lines += [*[f"![{f}]({f})" for f in summary["figures"]], ""]
    (out / "summary.md").write_text("\n".join(lines))
    return summary


# ----------------------------------------------------------------------------- command line


def add_mismatch_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megatron-gspo mismatch`."""
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="HF checkpoint dir, training checkpoint or run dir (server and trainer weights)",
    )
    parser.add_argument("--server-url", help="running SGLang server on the checkpoint (default: embedded)")
    add_prompt_args(parser, default_num_prompts=16)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0])
    parser.add_argument("--trainer-temperature", type=float, help="override the trainer's temperature")
    parser.add_argument("--samples-per-prompt", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="base sampling seed")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--ignore-eos", action="store_true", help="fixed-length responses")
    parser.add_argument(
        "--original-logprob", action="store_true", help="also compare the server's original-logprob mode"
    )
    parser.add_argument(
        "--original-server-url", help="running server in original-logprob mode (with --server-url)"
    )
    parser.add_argument("--out", required=True, help="output directory")


def run_mismatch_command(args: argparse.Namespace) -> int:
    """Entry point: generate, compare, write the report; prints the summary JSON and the by-length tables.

    A training checkpoint is exported to a temporary HF directory first (server and trainer load that).
    """
    prompts = prompt_source(args)  # bad prompt options fail before any export
    with hf_checkpoint_dir(args.checkpoint, "--checkpoint") as checkpoint:
        return _run_mismatch(args, str(checkpoint), prompts)


def _run_mismatch(args: argparse.Namespace, checkpoint: str, source: PromptSource) -> int:
    try:
        cfg = MismatchConfig(
            checkpoint=checkpoint,
            temperatures=tuple(args.temperatures),
            server_url=args.server_url,
            original_logprob=args.original_logprob,
            original_server_url=args.original_server_url,
            trainer_temperature=args.trainer_temperature,
            max_new_tokens=args.max_new_tokens,
            samples_per_prompt=args.samples_per_prompt,
            seed=args.seed,
            top_p=args.top_p,
            top_k=args.top_k,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as err:
        raise SystemExit(f"mismatch: {err}") from None
    from transformers import AutoTokenizer

    prompts = source.encode(AutoTokenizer.from_pretrained(checkpoint))
    summary = write_report(run_mismatch(cfg, prompts), args.out)
    print(json.dumps(summary, indent=2))
    print("\n".join(by_length_tables(summary)))
    return 0
