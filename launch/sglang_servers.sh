#!/usr/bin/env bash
# Start the SGLang rollout servers of this GPU node (run on each rollout node); prints their
# URLs for the trainer's SGLANG_URLS. The weight version is what the trainer syncs.
#
#   MODEL=/ckpt/Qwen3-30B-A3B TP=4 EP=4 DP=2 PORT=30000 launch/sglang_servers.sh [extra sglang args ...]
#
# DP>1 starts DP servers, one per data-parallel replica (TP GPUs each, from GPU r*TP; ports
# PORT, PORT+1, ...), not one server with --dp-size: SGLang refuses the weight-update group
# (and tensor updates) on a server launched with dp_size > 1, and the trainer refuses such a
# server at start-up. List every printed URL in SGLANG_URLS / rollout.server_urls.
#
# CONFIG=<the run's config YAML> makes the servers follow the run's settings:
# - rollout.deterministic_inference: true passes --enable-deterministic-inference, without
#   which SGLang does not reproduce a response from its sampling_seed (batching changes the
#   kernels' reduction order). DETERMINISTIC=1 / 0 overrides the config.
# - algorithm.routing_replay: r3 or drift.enabled: true passes --enable-return-routed-experts
#   (the experts each token was routed to; needed by R3 and the drift metrics, a cost
#   otherwise). ROUTED_EXPERTS=1 / 0 overrides the config; without CONFIG it is on.
# - rollout.quantization: fp8 passes --quantization fp8 (blockwise FP8 weights: the trainer's
#   weight sync sends FP8 e4m3 with per-128x128-block weight_scale_inv). QUANTIZATION=fp8 / none
#   overrides the config. With fp8 the script refuses (before SGLang starts, DRY_RUN too) a MODEL
#   whose config.json is not block FP8 (SGLang would quantise it per tensor online and drop the
#   trainer's block scales) and a TP/EP whose per-rank expert width moe_intermediate_size /
#   (TP / EP) is not a multiple of 128 (SGLang refuses to start): megatron_gspo/model/fp8/serving.py.
#   Qwen3-30B-A3B-FP8: TP=4 EP=4 (768 per rank); Qwen3-235B-A22B-FP8: TP=8 EP=8 (1536).
#
# ROUTER=1 also starts SGLang's router (pip `sglang-router`, in the `router` extra) on this node,
# in front of this node's servers and the URLs in ROUTER_WORKERS (comma-separated servers of
# other rollout nodes), on ROUTER_PORT (default PORT+100); it prints the router's URL for the
# trainer's SGLANG_ROUTER / rollout.router_url. The router runs in its own process group (it
# renames itself `sglang::router`), which Ctrl-C, SIGTERM or any server exiting takes down.
#
# Security: HOST defaults to 0.0.0.0 (every interface) because the trainer runs on other nodes
# and must reach this server over the network. SGLang's HTTP API has no authentication here:
# whoever can reach PORT can generate, pause the engine, and make it load weights from any path
# on this node (/update_weights_from_disk). Run it only on a trusted, private network, or
# firewall PORT to the trainer nodes; HOST=<private address> binds one interface,
# HOST=127.0.0.1 keeps it on this node (trainer on the same node).
set -euo pipefail
MODEL=${MODEL:?set MODEL to the HF checkpoint directory}
TP=${TP:-8}
DP=${DP:-1}
EP=${EP:-1}
PORT=${PORT:-30000}
HOST=${HOST:-0.0.0.0}
MEM_FRACTION=${MEM_FRACTION:-0.85}
DETERMINISTIC=${DETERMINISTIC:-}
ROUTED_EXPERTS=${ROUTED_EXPERTS:-}
QUANTIZATION=${QUANTIZATION:-}
ROUTER=${ROUTER:-0}
ROUTER_PORT=${ROUTER_PORT:-$((PORT + 100))}
ROUTER_WORKERS=${ROUTER_WORKERS:-}
case "$HOST" in
  0.0.0.0 | ::) ADVERTISE=${ADVERTISE_HOST:-$(hostname -f)} ;;  # the name other nodes reach
  *) ADVERTISE=$HOST ;;
esac
if [ -n "${CONFIG:-}" ]; then
  # The YAML file as written (dotlist overrides given to the trainer are not seen here).
  read -r CONFIG_DETERMINISTIC CONFIG_ROUTED CONFIG_QUANTIZATION <<<"$(python - "$CONFIG" <<'PY'
import sys

import yaml

with open(sys.argv[1], encoding="utf-8") as f:
    cfg = yaml.safe_load(f) or {}
deterministic = (cfg.get("rollout") or {}).get("deterministic_inference") is True
routed = (cfg.get("algorithm") or {}).get("routing_replay") == "r3" or (cfg.get("drift") or {}).get(
    "enabled"
) is True
quantization = (cfg.get("rollout") or {}).get("quantization") or "none"
print(int(deterministic), int(routed), quantization)
PY
)"
  DETERMINISTIC=${DETERMINISTIC:-$CONFIG_DETERMINISTIC}
  ROUTED_EXPERTS=${ROUTED_EXPERTS:-$CONFIG_ROUTED}
  QUANTIZATION=${QUANTIZATION:-$CONFIG_QUANTIZATION}
fi
ROUTED_EXPERTS=${ROUTED_EXPERTS:-1}
if [ "${QUANTIZATION:-none}" = fp8 ]; then  # the project's check, from this checkout
  ROOT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  PYTHONPATH="$ROOT_DIR${PYTHONPATH:+:$PYTHONPATH}" python -m megatron_gspo.model.fp8.serving "$MODEL" "$TP" "$EP"
fi
if [ "$HOST" = 0.0.0.0 ] || [ "$HOST" = "::" ]; then
  {
    echo "WARNING: binding SGLang to ${HOST}:${PORT}, every network interface, with no authentication."
    echo "WARNING: anyone who can reach this port can generate and replace the served weights."
    echo "WARNING: use a trusted private network or a firewall; HOST=<private address> binds one interface."
  } >&2
fi

# One server per DP replica: replica r on port PORT+r and GPUs r*TP .. r*TP+TP-1.
server_cmd() {
  local replica=$1
  CMD=(python -m sglang.launch_server --model-path "$MODEL" --host "$HOST" --port "$((PORT + replica))"
       --tp-size "$TP" --ep-size "$EP" --base-gpu-id "$((replica * TP))"
       --mem-fraction-static "$MEM_FRACTION" --enable-memory-saver --weight-version 0)
  if [ "$ROUTED_EXPERTS" = 1 ]; then
    CMD+=(--enable-return-routed-experts)
  fi
  if [ "${DETERMINISTIC:-0}" = 1 ]; then
    CMD+=(--enable-deterministic-inference)
  fi
  if [ "${QUANTIZATION:-none}" = fp8 ]; then
    CMD+=(--quantization fp8)
  fi
  CMD+=("${EXTRA_ARGS[@]}")
}
EXTRA_ARGS=("$@")

# The router in front of this node's servers and ROUTER_WORKERS (it waits for them to come up).
router_cmd() {
  local workers=()
  for ((r = 0; r < DP; r++)); do workers+=("http://${ADVERTISE}:$((PORT + r))"); done
  if [ -n "$ROUTER_WORKERS" ]; then IFS=, read -r -a more <<<"$ROUTER_WORKERS"; workers+=("${more[@]}"); fi
  ROUTER_CMD=(python -m sglang_router.launch_router --host "$HOST" --port "$ROUTER_PORT"
              --policy cache_aware --worker-startup-timeout-secs 1800 --worker-urls "${workers[@]}")
}

for ((r = 0; r < DP; r++)); do
  echo "rollout server URL: http://${ADVERTISE}:$((PORT + r))"
done
if [ "$ROUTER" = 1 ]; then
  router_cmd
  echo "rollout router URL: http://${ADVERTISE}:${ROUTER_PORT} (rollout.router_url / SGLANG_ROUTER)"
fi
if [ "${DRY_RUN:-0}" = 1 ]; then
  for ((r = 0; r < DP; r++)); do
    server_cmd "$r"
    echo "would run: ${CMD[*]}"
  done
  if [ "$ROUTER" = 1 ]; then echo "would run router: ${ROUTER_CMD[*]}"; fi
  exit 0
fi
if [ "$DP" = 1 ] && [ "$ROUTER" != 1 ]; then
  server_cmd 0
  exec "${CMD[@]}"
fi
PIDS=()
ROUTER_PGID=""
stop_all() {
  kill "${PIDS[@]}" 2>/dev/null || true
  if [ -n "$ROUTER_PGID" ]; then kill -TERM -- "-$ROUTER_PGID" 2>/dev/null || true; fi
}
trap 'stop_all; wait; exit 143' TERM INT
for ((r = 0; r < DP; r++)); do
  server_cmd "$r"
  "${CMD[@]}" &
  PIDS+=($!)
done
if [ "$ROUTER" = 1 ]; then
  setsid "${ROUTER_CMD[@]}" &  # a session of its own: its group is stopped as a whole
  ROUTER_PGID=$!
  PIDS+=("$ROUTER_PGID")
fi
# The first server to exit takes the others down (a node half-serving is not a deployment).
status=0
wait -n "${PIDS[@]}" || status=$?
stop_all
wait || true
exit "$status"
