"""CPU seconds of a torchrun job: workers as fresh interpreters vs forked from a pre-imported server.

    python benchmarks/bench_launch.py [--nproc 2 --repeats 3]

Two jobs, each launched both ways, interleaved, `--repeats` times:

- `imports`: a worker script that only imports what a trainer rank imports and exits: the launch
  cost alone;
- `train`: `megatron-gspo train` on the tiny CPU config, 1 SFT step and 1 RL step at EP=nproc (a
  short end-to-end run, embedded server included, as the suite's run tests start them).

`fresh` is torchrun's default (`python -m torch.distributed.run --standalone ... -m
megatron_gspo.cli train ...`, as GPU nodes run it: every worker imports torch and megatron-core);
`forked` is `train --nproc N` (training/torchrun.py: the workers are forked from a forkserver that
imported them once). CPU is every process of the job's tree, sampled from /proc every 0.1 s
(a forked worker's parent is the forkserver, whose own parent exits first, so
`RUSAGE_CHILDREN` would miss them). Prints each run and the medians' ratios.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HZ = os.sysconf("SC_CLK_TCK")
PROBE = "import megatron_gspo.training.forkserver_preload\n"


def _processes() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds so far) of every process on the machine."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after the command name: state, ppid, ...
        found[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / HZ)
    return found


def measure(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s of every process the command started, reparented ones included)."""
    start = time.monotonic()
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cpu = {job.pid: 0.0}
    while job.poll() is None:
        seen = _processes()
        grew = True
        while grew:  # a process is the job's once its parent was
            grew = False
            for pid, (parent, _) in seen.items():
                if pid not in cpu and parent in cpu:
                    cpu[pid], grew = 0.0, True
        for pid in cpu:
            if pid in seen:
                cpu[pid] = seen[pid][1]
        time.sleep(0.1)
    if job.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {job.returncode}:\n{job.stderr.read()[-3000:]}")
    return time.monotonic() - start, sum(cpu.values())


def commands(job: str, how: str, nproc: int, work: Path) -> list[str]:
    """The command of `job` launched `how` ("fresh" or "forked")."""
    from megatron_gspo.training.torchrun import forked_workers

    if job == "imports":
        probe = work / "probe.py"
        probe.write_text(PROBE)
        if how == "fresh":
            return [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={nproc}",
                str(probe),
            ]
        return [sys.executable, "-m", "megatron_gspo.training.torchrun", *forked_workers(nproc), str(probe)]
    run_dir = tempfile.mkdtemp(dir=work)
    train = ["train", "--config", str(REPO / "configs" / "tiny_moe_cpu.yaml"), "sft.steps=1",
             "sft.target_accuracy=null", "trainer.steps=1", f"parallel.expert_parallel={nproc}",
             "logging.progress_bar=false", f"trainer.run_dir={run_dir}"]  # fmt: skip
    if how == "fresh":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "-m", "megatron_gspo.cli", *train]  # fmt: skip
    return [sys.executable, "-m", "megatron_gspo.cli", *train, "--nproc", str(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        for job in ("imports", "train"):
            runs: dict[str, list[tuple[float, float]]] = {"fresh": [], "forked": []}
            for _ in range(args.repeats):
                for how in runs:  # interleaved: a noisy minute hits both
                    runs[how].append(measure(commands(job, how, args.nproc, Path(tmp)), env))
                    print(f"{job:8s} {how:7s} wall {runs[how][-1][0]:6.1f} s  CPU {runs[how][-1][1]:6.1f} s")
            wall = {how: statistics.median(r[0] for r in found) for how, found in runs.items()}
            cpu = {how: statistics.median(r[1] for r in found) for how, found in runs.items()}
            print(
                f"{job}, {args.nproc} workers, medians: CPU {cpu['fresh']:.1f} -> {cpu['forked']:.1f} s "
                f"(forked/fresh {cpu['forked'] / cpu['fresh']:.2f}), wall {wall['fresh']:.1f} -> "
                f"{wall['forked']:.1f} s ({wall['forked'] / wall['fresh']:.2f})"
            )


if __name__ == "__main__":
    main()
