#!/usr/bin/env bash
# Set up a CPU development environment in ./.venv (Python 3.11, torch 2.13.0 CPU wheel,
# megatron-core 0.16.1). Idempotent: re-running only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# The CPU torch build first: any other torch version would pull a multi-GB CUDA build.
pip install -q torch==2.13.0
pip install -q -e ".[dev]"
# SGLang's request/response contract types (sglang/api/v1/api_types.py) without its GPU stack.
pip install -q --no-deps "sglang==0.5.23"
python -c "import megatron_gspo, megatron.core, torch; print('megatron-gspo ready: torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
