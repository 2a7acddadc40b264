"""Expert-activation drift between two checkpoints, or a checkpoint and a rollout dump.

Same as `megatron-gspo drift`; see megatron_gspo/analysis/drift_cli.py for the options.
"""

import argparse
import sys

from megatron_gspo.analysis.drift_cli import add_drift_args, run_drift

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_drift_args(parser)
    sys.exit(run_drift(parser.parse_args()))
