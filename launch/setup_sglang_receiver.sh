#!/usr/bin/env bash
# A separate environment with SGLang's own weight-sync receiver code, for the tests that send the
# trainer's weights to it (tests/weight_sync/sglang_receiver_shim.py). Deployments run SGLang apart
# from the trainer; so do these tests. Idempotent.
#   bash launch/setup_sglang_receiver.sh          # ./.venv-sglang: Python 3.11, torch 2.13.0 CPU
# VENV=dir picks another directory, PYTHON another interpreter.
#
# What it holds: sglang 0.5.23 without its dependencies, plus the few packages its
# `sglang.srt.utils` import needs. That is enough to import the receiver pieces the tests run:
# `init_custom_process_group`, `FlattenedTensorBucket`, `NetworkAddress`, and the source of
# `WeightUpdater` / `SchedulerWeightUpdaterManager` / io_struct (their modules import
# torchvision, whose PyPI build needs SGLang's CUDA torch 2.14.1: a ~6 GB environment).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv-sglang}
if ! "$PY" -c '' >/dev/null 2>&1; then
  found=""
  for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/*/bin/"$PY"; do
    if "$cand" -c '' >/dev/null 2>&1; then found=$cand; fi
  done
  [ -n "$found" ] || { echo "setup_sglang_receiver.sh: no working Python '$PY' (set PYTHON)" >&2; exit 1; }
  PY=$found
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# --no-compile: Python compiles what is imported, on first import, instead of every file at install.
pip() { "$VENV/bin/python" -m pip "$@" --no-compile; }
pip install -q --upgrade pip
# torch 2.13.0: the CPU wheel on Python 3.11 (SGLang pins 2.14.1, a CUDA build; the receiver
# code used here runs on any torch >= 2.6).
pip install -q torch==2.13.0
# What `import sglang.srt.utils` needs (sglang's other ~200 dependencies are for serving; triton,
# ~1 GB installed, is imported at the top of sglang.srt.utils.common). Installed before sglang,
# whose own --no-deps install then leaves pip nothing to complain about.
pip install -q numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic \
  pyzmq tqdm ipython aiohttp triton
pip install -q --no-deps "sglang==0.5.23"
env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -W ignore -c "
from sglang.srt.utils.common import init_custom_process_group
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
import importlib.metadata as m, torch
print('SGLang receiver ready in $VENV: sglang', m.version('sglang'), '| torch', torch.__version__)"
