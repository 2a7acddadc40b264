#!/usr/bin/env bash
# The CPU demo: set up ./.venv, then cold-start SFT + GSPO on a tiny Megatron MoE with rollouts
# from the embedded SGLang-protocol server. Extra arguments are config overrides, e.g.
#   launch/demo_cpu.sh trainer.steps=10 trainer.seed=2
# CONFIG picks another demo, e.g. the code demo (needs bubblewrap: apt-get install -y bubblewrap):
#   CONFIG=configs/code_tiny_cpu.yaml launch/demo_cpu.sh
# With real SGLang 0.5.23 rollouts (its CPU engine; bash launch/setup_sglang.sh first, docs/sglang-on-cpu.md):
#   launch/demo_cpu.sh rollout.engine=sglang
# Under torchrun with gloo instead (TP2 or EP2 on CPU):
#   OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 2 -m megatron_gspo.cli train \
#     --config configs/tiny_moe_cpu.yaml parallel.expert_parallel=2
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_cpu.sh
# A new run directory per invocation, unless one is given (e.g. `--resume trainer.run_dir=runs/...`).
CONFIG=${CONFIG:-configs/tiny_moe_cpu.yaml}
RUN_DIR=("trainer.run_dir=runs/$(basename "$CONFIG" .yaml)/$(date +%Y%m%d-%H%M%S)")
for arg in "$@"; do
  case "$arg" in trainer.run_dir=*) RUN_DIR=() ;; esac
done
exec .venv/bin/megatron-gspo train --config "$CONFIG" "$@" "${RUN_DIR[@]}"
