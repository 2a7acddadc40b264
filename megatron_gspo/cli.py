"""`megatron-gspo` command line: one sub-command per job; each only builds its config and runs."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse the sub-command and run it; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="megatron-gspo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from megatron_gspo.model.parity import add_parity_args

    add_parity_args(sub.add_parser("parity", help="check a TP x EP layout against TP=EP=1"))

    from megatron_gspo.training.launch import add_train_args

    add_train_args(sub.add_parser("train", help="RL-train an MoE policy (GSPO/GRPO) from a YAML config"))

    args = parser.parse_args(argv)
    if args.command == "parity":
        from megatron_gspo.model.parity import run_parity

        return run_parity(args)
    if args.command == "train":
        from megatron_gspo.training.launch import run_train

        return run_train(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
