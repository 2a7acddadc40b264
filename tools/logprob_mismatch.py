"""Train/inference log-prob mismatch: SGLang's returned log-probs vs Megatron's on the same weights.

Same as `megatron-gspo mismatch`; see megatron_gspo/analysis/mismatch_cli.py for the options.
"""

import argparse
import sys

from megatron_gspo.analysis.mismatch_cli import add_mismatch_args, run_mismatch_command

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_mismatch_args(parser)
    sys.exit(run_mismatch_command(parser.parse_args()))
