#!/usr/bin/env bash
# Start one SGLang rollout server on this GPU node (run on each rollout node); prints its URL
# for the trainer's SGLANG_URLS. Routed experts are returned (needed by Routing Replay R3 and
# the inference->training drift metrics); the weight version is what the trainer syncs.
#
#   MODEL=/ckpt/Qwen3-30B-A3B TP=4 DP=2 PORT=30000 launch/sglang_servers.sh [extra sglang args ...]
#
# CONFIG=<the run's config YAML> makes the server follow the run's rollout settings: with
# rollout.deterministic_inference: true it passes --enable-deterministic-inference, without
# which SGLang does not reproduce a response from its sampling_seed (batching changes the
# kernels' reduction order). DETERMINISTIC=1 / 0 overrides the config.
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
if [ -z "$DETERMINISTIC" ] && [ -n "${CONFIG:-}" ]; then
  # The YAML file as written (dotlist overrides given to the trainer are not seen here).
  DETERMINISTIC=$(python - "$CONFIG" <<'PY'
import sys

import yaml

with open(sys.argv[1], encoding="utf-8") as f:
    cfg = yaml.safe_load(f) or {}
print(1 if (cfg.get("rollout") or {}).get("deterministic_inference") is True else 0)
PY
)
fi
if [ "$HOST" = 0.0.0.0 ] || [ "$HOST" = "::" ]; then
  {
    echo "WARNING: binding SGLang to ${HOST}:${PORT}, every network interface, with no authentication."
    echo "WARNING: anyone who can reach this port can generate and replace the served weights."
    echo "WARNING: use a trusted private network or a firewall; HOST=<private address> binds one interface."
  } >&2
fi

CMD=(python -m sglang.launch_server --model-path "$MODEL" --host "$HOST" --port "$PORT"
     --tp-size "$TP" --dp-size "$DP" --ep-size "$EP" --mem-fraction-static "$MEM_FRACTION"
     --enable-return-routed-experts --enable-memory-saver --weight-version 0)
if [ "${DETERMINISTIC:-0}" = 1 ]; then
  CMD+=(--enable-deterministic-inference)
fi
CMD+=("$@")
echo "rollout server URL: http://$(hostname -f):${PORT}"
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "would run: ${CMD[*]}"
  exit 0
fi
exec "${CMD[@]}"
