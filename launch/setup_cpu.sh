#!/usr/bin/env bash
# Set up a CPU development environment. Idempotent: re-running only checks what is installed.
#   bash launch/setup_cpu.sh                        # ./.venv: Python 3.11, torch 2.13.0 CPU wheel, megatron-core 0.16.1
#   PYTHON=python3.12 bash launch/setup_cpu.sh      # ./.venv312: Python 3.12, megatron-core 0.19.x
# VENV=dir picks another environment directory. PYTHON may name a pyenv version that is not on
# PATH (e.g. python3.12 with pyenv's shims): it is then looked up under $PYENV_ROOT/versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}

runs() { "$1" -c '' >/dev/null 2>&1; }
if ! runs "$PY"; then
  found=""
  for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/*/bin/"$PY"; do
    if runs "$cand"; then found=$cand; fi # the newest patch release sorts last
  done
  if [ -n "$found" ]; then
    PY=$found
  elif [ -z "${PYTHON:-}" ] && runs python3; then
    PY=python3
  else
    echo "setup_cpu.sh: no working Python '$PY' (set PYTHON=python3.11 or python3.12)" >&2
    exit 1
  fi
fi
PYVER=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
case "$PYVER" in
  3.11) DEFAULT_VENV=.venv ;;
  3.12) DEFAULT_VENV=.venv312 ;;
  *) echo "setup_cpu.sh: Python $PYVER is not supported (3.11 or 3.12)" >&2; exit 1 ;;
esac
VENV=${VENV:-$DEFAULT_VENV}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
# --no-compile: pip would byte-compile every file of every wheel (~75 s of CPU for torch,
# transformers and the rest); Python compiles what is imported instead, once, on first import.
pip() { command pip "$@" --no-compile; }
pip install -q --upgrade pip
# torch first. On Python 3.11 this is the 2.13.0 CPU wheel (any other version would pull a
# multi-GB CUDA build); on 3.12 there is only the CUDA build (~4.7 GB), which runs on CPU.
pip install -q torch==2.13.0
# megatron-core: 0.16.1 on Python 3.11 (its newest release there), 0.19.x on 3.12 (pyproject.toml).
pip install -q -e ".[dev,wandb,router]"
# SGLang's request/response contract types (sglang/api/v1/api_types.py) without its GPU stack.
pip install -q --no-deps "sglang==0.5.23"
# The check imports what a trainer rank and an embedded server import, so their bytecode is
# written here even where PYTHONDONTWRITEBYTECODE is set.
env -u PYTHONDONTWRITEBYTECODE python -W ignore -c "import sys, importlib.metadata as m, megatron_gspo.training.trainer, megatron_gspo.rollout.server.main, megatron_gspo.cli, megatron.core, torch; print('megatron-gspo ready in $VENV: Python', sys.version.split()[0], '| torch', torch.__version__, '| megatron-core', m.version('megatron-core'))"
