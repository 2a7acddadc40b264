#!/usr/bin/env bash
# The wheels launch/gpu_smoke.sh needs on an offline GPU machine whose Python 3.12 already has a
# CUDA PyTorch (>= 2.6; TransformerEngine, apex and SGLang optional): megatron-core 0.19.x with
# --no-deps (its torch requirement would fetch a multi-GB torch) and pyproject.toml's core
# dependencies, build requirements and `test` extra with everything they depend on, as CPython
# 3.12 manylinux x86_64 wheels (glibc >= 2.28). Torch and what only it brings (triton, nvidia-*,
# cuda-*) are left out. Run it where PyPI is reachable (bash >= 4, Python >= 3.11 with pip). It
# replaces the folder's wheels, prints the folder's size and fails above 64 MiB (the core is
# ~52 MiB: TensorBoard, matplotlib, math-verify and datasets are extras the smoke suite never
# imports, and together they would add ~109 MiB).
#
#   bash launch/gpu_smoke_wheels.sh            # into wheels/ (git-ignored); PYTHON=... picks the interpreter
#   bash launch/gpu_smoke_wheels.sh DIR        # into DIR
#   bash launch/gpu_smoke_wheels.sh --list     # print the requirements it would download; no network
#
# Then copy the folder with this repository to the GPU machine and, in the repository, with the
# Python that has torch (in a venv: `python3.12 -m venv` it and install torch there first):
#
#   pip install --no-index --find-links wheels -e ".[test]"
#   PYTHON=python3 bash launch/gpu_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIMIT_MIB=64
# pip accepts several --platform tags; wheels carry manylinux2014 / manylinux_2_17 / _2_28 tags.
TARGET=(--python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --only-binary=:all:)

case "${1:-}" in
  -h | --help)
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  --list) LIST=1 DEST= ;;
  -*)
    echo "gpu_smoke_wheels.sh: unknown option $1 (usage: [DIR] | --list | --help)" >&2
    exit 2
    ;;
  *) LIST=0 DEST=${1:-wheels} ;;
esac
[ $# -le 1 ] || {
  echo "gpu_smoke_wheels.sh: one argument at most, the folder (got $#)" >&2
  exit 2
}

# Requirements from pyproject.toml, one a line: "nodeps <req>" (megatron-core) or "deps <req>".
# Markers are evaluated for CPython 3.12 on Linux x86_64, not for the Python running this script.
requirements=$("$PY" - <<'EOF'
import re
import tomllib

try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement

TARGET = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)
wanted = [*project["build-system"]["requires"], *project["project"]["dependencies"],
          *project["project"]["optional-dependencies"]["test"]]
for text in wanted:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({**TARGET, "extra": ""}):
        continue
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if name == "torch":  # the GPU machine's own CUDA build
        continue
    req.marker = None
    print("nodeps" if name == "megatron-core" else "deps", req)
EOF
)
mapfile -t NODEPS < <(awk '$1 == "nodeps" { $1 = ""; sub(/^ /, ""); print }' <<<"$requirements")
mapfile -t DEPS < <(awk '$1 == "deps" { $1 = ""; sub(/^ /, ""); print }' <<<"$requirements")
if [ "${#NODEPS[@]}" -ne 1 ]; then
  echo "gpu_smoke_wheels.sh: expected one megatron-core requirement for Python 3.12 in pyproject.toml," \
    "found ${#NODEPS[@]}" >&2
  exit 1
fi
if [ "$LIST" = 1 ]; then
  printf '%s  (--no-deps)\n' "${NODEPS[@]}"
  printf '%s\n' "${DEPS[@]}"
  exit 0
fi

start=$SECONDS
mkdir -p "$DEST"
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/gpu-smoke-wheels-XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
"$PY" -m pip download -q --disable-pip-version-check -d "$STAGE" --no-deps "${TARGET[@]}" "${NODEPS[@]}"
"$PY" -m pip download -q --disable-pip-version-check -d "$STAGE" "${TARGET[@]}" "${DEPS[@]}"
# Should a dependency ever pull torch, drop it and what only it brings: the machine has its own.
shopt -s nullglob
dropped=("$STAGE"/torch-*.whl "$STAGE"/triton-*.whl "$STAGE"/nvidia_*.whl "$STAGE"/cuda_*.whl)
if [ "${#dropped[@]}" -gt 0 ]; then
  echo "left out (the GPU machine's torch brings them): ${dropped[*]##*/}"
  rm -f "${dropped[@]}"
fi
rm -f "$DEST"/*.whl
mv "$STAGE"/*.whl "$DEST"/
read -r count bytes < <("$PY" -c 'import pathlib, sys
wheels = list(pathlib.Path(sys.argv[1]).glob("*.whl"))
print(len(wheels), sum(w.stat().st_size for w in wheels))' "$DEST")
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "$DEST: $count wheels, $mib MiB (limit $LIMIT_MIB MiB), $((SECONDS - start)) s;" \
  "megatron-core: $(cd "$DEST" && ls megatron_core-*.whl)"
if [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "FAIL  $DEST holds $mib MiB, over the $LIMIT_MIB MiB limit" >&2
  exit 1
fi
