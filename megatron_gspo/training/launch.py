"""`megatron-gspo train`: build the config, train, clean up.

    megatron-gspo train --config configs/tiny_moe_cpu.yaml trainer.steps=3 algorithm.loss_type=grpo
    megatron-gspo train --config configs/tiny_moe_cpu.yaml --resume
    megatron-gspo train --config configs/tiny_moe_cpu.yaml parallel.expert_parallel=2 --nproc 2

Under torchrun every worker runs the same command. On a CPU machine `--nproc N` re-launches
the command under torchrun with N gloo workers.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from megatron_gspo.errors import USER_ERROR_FILE_ENV


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megatron-gspo train`."""
    parser.add_argument("--config", default=None, help="YAML run config (see megatron_gspo/config/)")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.steps=3")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument(
        "--resume-or-start",
        action="store_true",
        help="continue from the latest checkpoint, or start fresh when there is none",
    )
    parser.add_argument("--nproc", type=int, default=1, help="re-launch under torchrun with N CPU workers")


def relaunch(nproc: int) -> int:
    """Run this command again under torchrun with `nproc` CPU workers; a worker's user error once, exit 2.

    SIGTERM, SIGINT and SIGHUP are forwarded to the whole job, and the launcher returns only
    when every process of it has exited.
    """
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
    from megatron_gspo.training import torchrun

    torchrun_args = [*torchrun.forked_workers(nproc), torchrun.WORKER_CLI, *argv]
    with tempfile.TemporaryDirectory(prefix="megatron-gspo-launch-") as tmp:
        error_file = os.path.join(tmp, "user_error")
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            USER_ERROR_FILE_ENV: error_file,
        }
        pid, stderr = _start_torchrun(torchrun_args, env)
        with _forward_signals(pid) as received, stderr:
            silenced = False
            for line in stderr:
                # A worker reported a user error (once): torchrun's ChildFailedError report
                # that follows is noise about our own exit code, not news to the user.
                silenced = silenced or os.path.exists(error_file)
                if not silenced:
                    sys.stderr.write(line)
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            _wait_for_group(pid)
        if os.path.exists(error_file):
            first, _, message = Path(error_file).read_text().partition("\n")
            sys.stderr.write(message)
            return int(first)
        return 128 + received[0] if received else code


def _start_torchrun(args: list[str], env: dict[str, str]) -> tuple[int, TextIO]:
    """The torchrun agent in a forked child that leads its own session; (its pid, its stderr).

    Forked rather than started: this process has imported torch already (validation), and a
    fresh interpreter would import it again (~2-3 s of CPU per launch). In its own session, a
    signal to this launcher reaches torchrun, the workers and the embedded rollout server
    through `_forward_signals`, and none of them outlives it.
    """
    from megatron_gspo.training import torchrun

    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the agent: never returns
        code = 1
        try:
            os.setsid()
            os.close(read)
            os.dup2(write, sys.stderr.fileno())
            os.close(write)
            os.environ.clear()
            os.environ.update(env)
            sys.argv = ["torchrun", *args]
            code = torchrun.run()
        except SystemExit as stop:  # argparse's errors: the status the torchrun command exits with
            code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
        except BaseException:  # e.g. torchrun's ChildFailedError, reported as an uncaught error would be
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write)
    return pid, os.fdopen(read, "r", buffering=1)


@contextlib.contextmanager
def _forward_signals(pgid: int) -> Iterator[list[int]]:
    """Pass SIGTERM / SIGINT / SIGHUP on to the process group `pgid`; yields the signals received."""
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signum)

    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {signum: signal.signal(signum, forward) for signum in forwarded}
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _wait_for_group(pgid: int, grace_s: float = 60.0) -> None:
    """Wait until no process of group `pgid` is left; SIGKILL the stragglers after `grace_s`."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            return
        time.sleep(0.1)


def run_train(args: argparse.Namespace) -> int:
    """Entry point; returns the exit status (2 for a configuration error)."""
    from megatron_gspo.config import ConfigError, load_config, validate
    from megatron_gspo.config.value_checks import ValueCheckError, check_run_dir_writable

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
    from megatron_gspo.termination import exit_on_sigterm

    exit_on_sigterm()
    rank0 = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(
        level=cfg.logging.level.upper() if rank0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "megatron"):  # per-request and per-bucket INFO lines drown the run's own log
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from megatron_gspo.training.trainer import train

    try:
        result = train(cfg)  # a ConfigError raised after start-up is reported by the CLI (exit 2)
    except (KeyboardInterrupt, SystemExit) as stop:
        code = 130 if isinstance(stop, KeyboardInterrupt) else stop.code
        if code not in (130, 143):  # only SIGINT (Ctrl-C) and SIGTERM are a stop, not a failure
            raise
        if rank0:
            print(stopped_message(cfg.trainer.run_dir, code), file=sys.stderr, flush=True)
        return code
    if rank0:
        for record in result["evals"]:
            print(f"step {record['step']}: held-out accuracy {record['eval/accuracy']:.3f}", flush=True)
    return 0


def stopped_message(run_dir: str, code: int) -> str:
    """One line for a run stopped by Ctrl-C or SIGTERM: what was saved, what is lost, how to go on."""
    from megatron_gspo.checkpoint.source import CHECKPOINTS_DIR
    from megatron_gspo.checkpoint.steps import latest_step

    signal_name = "Ctrl-C" if code == 130 else "SIGTERM"
    root = Path(run_dir, CHECKPOINTS_DIR)
    try:
        step = latest_step(root)
    except Exception:  # noqa: BLE001 - a damaged `latest` is for --resume to sort out, not this line
        step = None
    if step is None:
        return (
            f"megatron-gspo train: stopped by {signal_name}; no checkpoint was saved: a new run starts over"
        )
    return (
        f"megatron-gspo train: stopped by {signal_name}; saved: {root} up to step {step} (resume with "
        "--resume); lost: the steps after it"
    )
