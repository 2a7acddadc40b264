#!/usr/bin/env bash
# Launch `megatron-gspo train` on H100 nodes with torchrun (run once on every node).
#
#   MODEL=/ckpt/Qwen3-30B-A3B DATA=/data/math.jsonl SGLANG_URLS=http://sgl-0:30000,http://sgl-1:30000 \
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=trainer-0 launch/train_h100.sh configs/qwen3_30b_a3b_gspo.yaml [key=value ...]
#
# Several nodes: run the same command on every training node, NODE_RANK=0..NNODES-1 (0 on the
# node that is MASTER_ADDR). With NNODES > 1 torchrun meets over c10d rendezvous at
# MASTER_ADDR:MASTER_PORT (RDZV_ID names the job; every node must give the same one; it
# defaults to the config's file name), so the nodes may start in any order within
# RDZV_TIMEOUT seconds; RDZV=static uses torchrun's fixed --master_addr/--node_rank instead.
# Rollouts behind SGLang's router: SGLANG_ROUTER=http://rollout-0:30100 (printed by
# launch/sglang_servers.sh ROUTER=1) instead of SGLANG_URLS.
#
# DRY_RUN=1 prints the torchrun command and runs `megatron-gspo plan` (config validation and a
# per-GPU memory estimate for the world size) instead of training; it works on a CPU machine.
set -euo pipefail
CONFIG=${1:?usage: launch/train_h100.sh CONFIG [section.key=value ...]}
shift
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV=${RDZV:-c10d}
RDZV_ID=${RDZV_ID:-$(basename "$CONFIG" .yaml)}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-900}
WORLD_SIZE=$((NNODES * GPUS_PER_NODE))
if [ -n "${SGLANG_URLS:-}" ] && [ -n "${SGLANG_ROUTER:-}" ]; then
  echo "train_h100.sh: set SGLANG_URLS or SGLANG_ROUTER, not both (the router lists its servers)" >&2
  exit 2
fi

OVERRIDES=()
[ -n "${MODEL:-}" ] && OVERRIDES+=("model.hf_path=${MODEL}")
[ -n "${DATA:-}" ] && OVERRIDES+=("task.options.path=${DATA}")
[ -n "${SGLANG_URLS:-}" ] && OVERRIDES+=("rollout.server_urls=[${SGLANG_URLS}]")
[ -n "${SGLANG_ROUTER:-}" ] && OVERRIDES+=("rollout.router_url=${SGLANG_ROUTER}")
OVERRIDES+=("$@")

# NCCL / megatron settings that matter on H100 + InfiniBand; all overridable from the environment.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # SP/TP comm-compute overlap ordering
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# Segments grow in place instead of leaving fragments between variable-length micro-batches
# (`plan` counts 79.1 GiB per H100 and a reserve, not room for fragmentation).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# The control plane's gloo groups bind the address this host's name resolves to, which can be
# 127.0.1.1 or a docker bridge; across nodes they must use the interface that reaches MASTER_ADDR.
route_ifname() {  # the interface on the route to host $1; this host: the one holding its address,
  local addr dev   # or the default route's where its name maps to loopback (127.0.1.1)
  addr=$(getent ahostsv4 "$1" 2>/dev/null | awk 'NR == 1 {print $1}' || true)
  [ -n "$addr" ] || return 0
  dev=$(ip -o route get "$addr" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p' || true)
  if [ "$dev" = lo ] && [ "${addr#127.}" != "$addr" ]; then
    dev=$(ip -o route show default 2>/dev/null | sed -n '1s/.* dev \([^ ]*\).*/\1/p' || true)
  elif [ "$dev" = lo ]; then
    dev=$(ip -o -4 addr show 2>/dev/null | awk -v a="$addr" 'index($4, a "/") == 1 {print $2; exit}' || true)
  fi
  printf '%s' "$dev"
}
if [ "$NNODES" -gt 1 ] && [ -z "${GLOO_SOCKET_IFNAME:-}" ]; then
  GLOO_SOCKET_IFNAME=$(route_ifname "$MASTER_ADDR")
  if [ -n "$GLOO_SOCKET_IFNAME" ]; then export GLOO_SOCKET_IFNAME; fi
fi

CMD=(torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE")
if [ "$NNODES" -gt 1 ] && [ "$RDZV" = c10d ]; then
  # The rendezvous host is MASTER_ADDR (NODE_RANK 0 hosts the c10d store there).
  CMD+=(--rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR}:${MASTER_PORT}" --rdzv-id "$RDZV_ID"
        --rdzv-conf "timeout=${RDZV_TIMEOUT}")
else
  CMD+=(--master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
fi
CMD+=(-m megatron_gspo.cli train --config "$CONFIG" "${OVERRIDES[@]}")

if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "would run on node ${NODE_RANK}/${NNODES}: PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF}" \
    "${GLOO_SOCKET_IFNAME:+GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME} }${CMD[*]}"
  exec megatron-gspo plan --config "$CONFIG" --world-size "$WORLD_SIZE" "${OVERRIDES[@]}"
fi
exec "${CMD[@]}"
