"""The command that runs a test's worker script under torchrun with `nproc` gloo ranks.

The ranks are forked from one server that has imported torch, megatron-core and this package,
as `train --nproc` starts them (`megatron_gspo.training.torchrun`): those imports cost ~7 s of
CPU per process on a 2-core box, which a 4-rank test used to pay four times. torchrun runs
the script with `runpy.run_path`, so a worker that imports a module beside it puts its own
directory on `sys.path`.
"""

from pathlib import Path

from warm_python import python

from megatron_gspo.training.torchrun import forked_workers


def torchrun(nproc: int, script: str | Path) -> list[str]:
    """`python -m megatron_gspo.training.torchrun ... SCRIPT`: append the script's arguments."""
    launcher = [*python(), "-m", "megatron_gspo.training.torchrun", *forked_workers(nproc)]
    return [*launcher, str(Path(script).resolve())]
