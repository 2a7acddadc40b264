"""torchrun's workers forked from the server that imported what a rank imports (training/torchrun.py).

A forkserver swallows an ImportError of its preload list, so a broken `forkserver_preload` would only
make every launch slower; here each worker finds megatron-core and the trainer imported before
its script's first line runs, and torchrun's environment is each worker's own.
"""

import json
import os
import subprocess

import pytest
from forked_torchrun import torchrun

PROBE = """
import json, os, sys
imported = [name for name in ("megatron.core", "megatron_gspo.training.trainer") if name in sys.modules]
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as out:
    json.dump({"imported": imported, "world": os.environ["WORLD_SIZE"], "pid": os.getpid()}, out)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_workers_start_with_megatron_imported(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    done = subprocess.run(
        [*torchrun(2, probe), str(tmp_path)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["imported"] for r in ranks] == [["megatron.core", "megatron_gspo.training.trainer"]] * 2
    assert [r["world"] for r in ranks] == ["2", "2"] and ranks[0]["pid"] != ranks[1]["pid"]
