"""Profile a run's RL steps (rollout, pack, forward/backward, optimizer, weight sync), not its cold start.

    OMP_NUM_THREADS=1 python benchmarks/profile_rl_step.py [--config C] [--top 25] [key=value ...]

Runs `megatron-gspo train` in this process with cProfile switched on only inside
`Trainer.train_step`, then prints the RL wall time (sum of the steps), its split from the
step metrics and the top functions by own time and by cumulative time. SFT, evaluation
and checkpoints are outside the profile.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time

from megatron_gspo.config import load_config
from megatron_gspo.training import trainer as trainer_module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny_moe_cpu.yaml")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--dump", help="also write the raw profile here (pstats format)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. trainer.steps=20")
    args = parser.parse_args()
    run_dir = tempfile.mkdtemp(prefix="profile_rl_step-")
    overrides = ["logging.progress_bar=false", f"trainer.run_dir={run_dir}", *args.overrides]
    cfg = load_config(args.config, overrides)

    profiler = cProfile.Profile()
    wall = []
    original = trainer_module.Trainer.train_step

    def profiled_step(self, engine):
        start = time.perf_counter()
        profiler.enable()
        try:
            return original(self, engine)
        finally:
            profiler.disable()
            wall.append(time.perf_counter() - start)

    trainer_module.Trainer.train_step = profiled_step
    result = trainer_module.train(cfg)
    print(f"RL steps: {len(wall)}, RL wall {sum(wall):.2f} s, {sum(wall) / max(len(wall), 1):.3f} s/step")
    last = result["last"]
    for key in ("time/rollout_s", "time/train_s", "time/sync_s"):
        if key in last:
            print(f"  last step {key} = {last[key]:.3f}")
    stats = pstats.Stats(profiler)
    if args.dump:
        stats.dump_stats(args.dump)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
