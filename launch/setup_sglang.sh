#!/usr/bin/env bash
# SGLang 0.5.23 with its own dependencies, in its own environment, serving on this machine's CPU
# (docs/sglang-on-cpu.md). Deployments run SGLang apart from the trainer; so do the tests that
# start real SGLang servers or send the trainer's weights to SGLang's receiver. Idempotent.
#   bash launch/setup_sglang.sh          # ./.venv-sglang: Python 3.11, sglang 0.5.23, torch 2.14.1
# VENV=dir picks another directory, PYTHON another interpreter.
#
# What it installs beside SGLang, both only used where there is no GPU:
# - .venv-sglang/lib/sglang-cpu/libcuda.so.1, built from patches/sglang_cpu/libcuda_stub.c: the
#   one driver symbol that sgl_kernel's import needs;
# - a .pth file that, in a process started with SGLANG_USE_CPU_ENGINE=1, loads
#   patches/sglang_cpu/gpuless.py: it preloads that library when no driver is installed and
#   fixes two of SGLang's GPU-less bugs at import time. It holds this checkout's absolute path:
#   run the script again if the checkout moves.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv-sglang}
SGLANG_VERSION=0.5.23
if ! "$PY" -c '' >/dev/null 2>&1; then
  found=""
  for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/*/bin/"$PY"; do
    if "$cand" -c '' >/dev/null 2>&1; then found=$cand; fi
  done
  [ -n "$found" ] || { echo "setup_sglang.sh: no working Python '$PY' (set PYTHON)" >&2; exit 1; }
  PY=$found
fi
command -v gcc >/dev/null || { echo "setup_sglang.sh: gcc is needed to build the libcuda.so.1 stand-in" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# --no-compile: Python compiles what is imported, on first import, instead of every file at install.
pip() { "$VENV/bin/python" -m pip "$@" --no-compile; }
pip install -q --upgrade pip
# SGLang pins its torch (2.14.1, a CUDA build that runs on the CPU) and ~200 other packages.
pip install -q "sglang==$SGLANG_VERSION"

STUB_DIR="$VENV/lib/sglang-cpu"
mkdir -p "$STUB_DIR"
if [ ! -e "$STUB_DIR/libcuda.so.1" ] || [ patches/sglang_cpu/libcuda_stub.c -nt "$STUB_DIR/libcuda.so.1" ]; then
  gcc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$STUB_DIR/libcuda.so.1" patches/sglang_cpu/libcuda_stub.c
fi
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
SHIM="$PWD/patches/sglang_cpu/gpuless.py"
# A .pth line starting with `import` runs at every interpreter start, SGLang's spawned scheduler
# and detokenizer processes included; it does nothing unless SGLANG_USE_CPU_ENGINE=1.
printf 'import os, runpy; os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and runpy.run_path(%s)\n' \
  "'$SHIM'" >"$SITE/megatron_gspo_sglang_cpu.pth"

env -u PYTHONDONTWRITEBYTECODE SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -W ignore -c "
import importlib.metadata as m, torch
import sglang.srt.entrypoints.http_server  # what launch_server imports, sgl_kernel included
print('SGLang ready in $VENV: sglang', m.version('sglang'), '| torch', torch.__version__, '| CUDA', torch.cuda.is_available())"
