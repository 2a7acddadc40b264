"""`megatron-gspo ...` through the CLI's own `main`, in the test's process.

For what is refused or computed before any model, process group or server exists (config
errors, `plan`): an interpreter and its imports saved per call. Runs and launches that start
processes stay in subprocesses, as a user starts them.
"""

import contextlib
import io
import subprocess
from pathlib import Path

from megatron_gspo.cli import main

REPO = Path(__file__).resolve().parents[1]


def run_cli_in_process(*args: str) -> subprocess.CompletedProcess:
    """`main(args)` from the repository root, stdout and stderr captured, as `subprocess.run` returns them."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's refusals
            code = exit_.code
    return subprocess.CompletedProcess(["megatron-gspo", *args], code, out.getvalue(), err.getvalue())
