"""`megatron-gspo` command line: one sub-command per job; each only builds its config and runs.

megatron-gspo train  --config configs/tiny_moe_cpu.yaml [section.key=value ...] [--resume]
megatron-gspo serve  --model DIR [--port P]          embedded SGLang-protocol rollout server (CPU)
megatron-gspo parity --tp 2 --ep 2 [--pp 2]          check a TP x EP x PP layout against TP=EP=PP=1
megatron-gspo plan   --config C --world-size N       dry-run a GPU layout: validation + memory
megatron-gspo export --checkpoint RUN/checkpoints/step_N --out HF_DIR   training checkpoint -> HF
megatron-gspo drift  --a CKPT (--b CKPT | --dump F)  expert-activation drift tables, plots, summary
megatron-gspo mismatch --checkpoint CKPT [--server-url U]  rollout vs trainer log-prob mismatch report
megatron-gspo report RUN_DIR [--out F.html]            a run's metrics as one self-contained HTML page
megatron-gspo score DATA --row N --program F           one program on a code problem's tests, per test
(CKPT: an HF checkpoint directory, a training checkpoint (exported to a temporary HF directory
first), or a run directory: its newest intact checkpoint)
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (help, module, function adding the arguments, function running the command)
COMMANDS = {
    "train": (
        "RL-train an MoE policy (GSPO/GRPO) from a YAML config",
        "megatron_gspo.training.launch",
        "add_train_args",
        "run_train",
    ),
    "parity": (
        "check a TP x EP layout against TP=EP=1",
        "megatron_gspo.analysis.parity",
        "add_parity_args",
        "run_parity",
    ),
    "export": (
        "write a training checkpoint (any layout) as an HF checkpoint directory",
        "megatron_gspo.training.export",
        "add_export_args",
        "run_export",
    ),
    "plan": (
        "validate a config for a world size and estimate per-GPU memory",
        "megatron_gspo.plan",
        "add_plan_args",
        "run_plan",
    ),
    "drift": (
        "expert-activation drift between two checkpoints or a checkpoint and a rollout dump",
        "megatron_gspo.analysis.drift_cli",
        "add_drift_args",
        "run_drift",
    ),
    "mismatch": (
        "train/inference log-prob mismatch: rollout server vs Megatron on the same weights",
        "megatron_gspo.analysis.mismatch_cli",
        "add_mismatch_args",
        "run_mismatch_command",
    ),
    "report": (
        "a run's metrics.jsonl as one self-contained HTML page (curves, drift heatmaps)",
        "megatron_gspo.analysis.run_report",
        "add_report_args",
        "run_report",
    ),
    "score": (
        "run one program (or a completion's) on a code problem's tests, as training scores it",
        "megatron_gspo.analysis.score_cli",
        "add_score_args",
        "run_score",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Parse the sub-command and run it; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the server owns its arguments (also `python -m megatron_gspo.rollout.server`)
        from megatron_gspo.rollout.server.main import main as serve

        return serve(argv[1:])
    parser = argparse.ArgumentParser(
        prog="megatron-gspo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="embedded SGLang-protocol rollout server (see `megatron-gspo serve -h`)")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the traceback of user errors too")
    for name, (help_text, module, add_args, _) in COMMANDS.items():
        getattr(importlib.import_module(module), add_args)(
            sub.add_parser(name, help=help_text, parents=[common])
        )
    args, extra = parser.parse_known_args(argv)
    # argparse fills a `nargs="*"` positional once: dotlist overrides that follow an option
    # (`train --nproc 2 parallel.expert_parallel=2`) come back as extras; they are overrides too.
    if extra and hasattr(args, "overrides") and not any(arg.startswith("-") for arg in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _, module, _, run = COMMANDS[args.command]
    from megatron_gspo.errors import ConfigError, DiskFullError, report_user_error
    from megatron_gspo.rollout.errors import RolloutFault

    try:
        return getattr(importlib.import_module(module), run)(args)
    except ConfigError as err:  # a bad config is the user's to fix: say what, no traceback
        if args.debug:
            raise
        report_user_error(f"megatron-gspo {args.command}: config error: {err}")
        return 2
    except DiskFullError as err:  # the message says what was kept and how to go on
        if args.debug:
            raise
        report_user_error(f"megatron-gspo {args.command}: {err}")
        return 2
    except RolloutFault as err:
        # A rollout server died or hung mid-run: the message names it; the checkpoints stay.
        if args.debug:
            raise
        report_user_error(f"megatron-gspo {args.command}: rollout server failed: {err}", code=1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
