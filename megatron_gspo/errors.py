"""The error every user-facing command reports as one named line (exit 2), without a traceback.

`report_user_error` prints it; under `train --nproc N` the first worker hands it to the launcher,
so it is printed once for the whole job.
"""

import contextlib
import os
import sys


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field and says why."""


class DiskFullError(Exception):
    """A write ran out of disk space; the message names where, how much it needed and what was kept."""


# Set by `train --nproc N` for its workers: the first worker to report a user error creates it,
# so the message is printed once and the launcher knows not to dump torchrun's failure report.
USER_ERROR_FILE_ENV = "MEGATRON_GSPO_USER_ERROR_FILE"


def report_user_error(message: str, code: int = 2) -> None:
    """Print a user error on stderr; under `train --nproc N` hand it and its exit code to the launcher."""
    path = os.environ.get(USER_ERROR_FILE_ENV)
    if not path:
        print(message, file=sys.stderr, flush=True)
        return
    with contextlib.suppress(FileExistsError), open(path, "x") as f:  # the first worker wins
        f.write(f"{code}\n{message}\n")


def report_verdict(code: int) -> None:
    """Under `--nproc N` (or a re-launch): this exit status is the command's printed answer, not a crash.

    The launcher then exits with `code` and shows no torchrun failure report (no message of its own).
    """
    path = os.environ.get(USER_ERROR_FILE_ENV)
    if path:
        with contextlib.suppress(FileExistsError), open(path, "x") as f:
            f.write(f"{code}\n")
