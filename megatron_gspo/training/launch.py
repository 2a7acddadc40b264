"""`megatron-gspo train`: build the config, train, clean up.

    megatron-gspo train --config configs/tiny_moe_cpu.yaml trainer.steps=3 algorithm.loss_type=grpo
    megatron-gspo train --config configs/tiny_moe_cpu.yaml --resume
    megatron-gspo train --config configs/tiny_moe_cpu.yaml parallel.expert_parallel=2 --nproc 2

Under torchrun every worker runs the same command. On a CPU machine `--nproc N` re-launches
the command under torchrun with N gloo workers.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_gspo.cli import USER_ERROR_FILE_ENV


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megatron-gspo train`."""
    parser.add_argument("--config", default=None, help="YAML run config (see megatron_gspo/config.py)")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.steps=3")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument(
        "--resume-or-start",
        action="store_true",
        help="continue from the latest checkpoint, or start fresh when there is none",
    )
    parser.add_argument("--nproc", type=int, default=1, help="re-launch under torchrun with N CPU workers")


def relaunch(nproc: int) -> int:
    """Run this command again under torchrun with `nproc` CPU workers; a worker's user error once, exit 2."""
    # Workers must not see --nproc: torchrun's own parser would take it for --nproc-per-node.
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip or arg.startswith("--nproc="):
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        argv.append(arg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "megatron_gspo.cli", *argv]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="megatron-gspo-launch-") as tmp:
        error_file = os.path.join(tmp, "user_error")
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            USER_ERROR_FILE_ENV: error_file,
        }
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
        silenced = False
        for line in proc.stderr:
            # A worker reported a user error (once, exit 2): torchrun's ChildFailedError report
            # that follows is noise about our own exit code, not news to the user.
            silenced = silenced or os.path.exists(error_file)
            if not silenced:
                sys.stderr.write(line)
        code = proc.wait()
        if os.path.exists(error_file):
            sys.stderr.write(Path(error_file).read_text())
            return 2
        return code


def run_train(args: argparse.Namespace) -> int:
    """Entry point; returns the exit status (2 for a configuration error)."""
    from megatron_gspo.config import ConfigError, load_config, validate
    from megatron_gspo.config_checks import ValueCheckError, check_run_dir_writable

    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    overrides = list(args.overrides)
    if args.resume or args.resume_or_start:
        overrides.append("trainer.resume=true")
    if args.resume_or_start:
        overrides.append("trainer.resume_or_start=true")
    cfg = load_config(args.config, overrides)  # a ConfigError is reported by the CLI (exit 2)
    relaunching = args.nproc > 1 and "RANK" not in os.environ
    # Everything checkable is checked before any worker starts and before the run dir is made.
    validate(cfg, world_size=args.nproc if relaunching else int(os.environ.get("WORLD_SIZE", "1")))
    try:
        check_run_dir_writable(cfg.trainer.run_dir)  # before SFT, not at the first checkpoint
    except ValueCheckError as err:
        raise ConfigError(str(err)) from None
    if relaunching:
        return relaunch(args.nproc)
    # SIGTERM unwinds like Ctrl-C, so the embedded rollout server and exported weights are cleaned up.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    rank0 = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(
        level=cfg.logging.level.upper() if rank0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "megatron"):  # per-request and per-bucket INFO lines drown the run's own log
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from megatron_gspo.training.trainer import train

    result = train(cfg)  # a ConfigError raised after start-up is reported by the CLI (exit 2)
    if rank0:
        for record in result["evals"]:
            print(f"step {record['step']}: held-out accuracy {record['eval/accuracy']:.3f}", flush=True)
    return 0
