#!/usr/bin/env bash
# GPU smoke suite: run tests/gpu and print one verdict line per check, PASS / FAIL / SKIP + name
# + figure or reason. Exit status 1 when any check fails; on a machine without CUDA every check
# is a SKIP saying why, and the exit status is 0.
#
#   bash launch/gpu_smoke.sh                 # PYTHON=... picks the interpreter (default .venv/bin/python, else python3)
#   LOG=smoke.log bash launch/gpu_smoke.sh   # where pytest's full output goes (default: a file under $TMPDIR)
#
# 1 GPU: NCCL world of one; local spec in bf16 (build, packed == one-sample-per-row, HF round
# trip); with TransformerEngine: TE spec + bf16 + grouped GEMM builds (tiny and 4-layer), THD
# packed == one-per-row, HF <-> Megatron round trip with TE names; colocation (a CUDA IPC bucket
# opened by another process beside expandable segments, offloaded memory back to the driver);
# context parallelism; 5 GSPO steps against the
# embedded server; peak memory vs `megatron-gspo plan`'s estimate. 2+ GPUs: `megatron-gspo
# parity` at TP2, EP2 and (4+ GPUs) TP2 x EP2 under torchrun.
#
# An offline GPU machine needs only a CUDA PyTorch (>= 2.6) in Python 3.12; TE, apex and SGLang
# are optional. launch/gpu_smoke_wheels.sh, run beforehand where PyPI is reachable, fetches the
# rest into wheels/ (~51 MiB: megatron-core 0.19.x with --no-deps, the core dependencies and the
# test runner, as manylinux wheels for CPython 3.12). Then on the GPU machine, in this repository:
#
#   pip install --no-index --find-links wheels -e ".[test]"
#   PYTHON=python3 bash launch/gpu_smoke.sh
#
# One GPU: estimated 2-4 min, not yet measured; the 5-step training run (SFT warm-up included;
# its embedded server generates on the host CPU) dominates. A hang is cut only by pytest's
# per-test timeout below (30 min), longer than a short GPU lease.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
fi
# No network: never let transformers / huggingface_hub try to reach the Hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # megatron's TP/SP ordering
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

if ! env_error=$("$PY" -W ignore -c "import torch, pytest, megatron.core, megatron_gspo" 2>&1); then
  echo "FAIL  environment  $PY cannot import torch / pytest / megatron-core / megatron_gspo:" \
    "$(printf '%s' "$env_error" | tail -n 1); install them as the top of launch/gpu_smoke.sh says"
  exit 1
fi
"$PY" -W ignore - <<'EOF'
import importlib.metadata as md
import importlib.util

import torch

def imports(name):
    try:
        __import__(name)
    except Exception as err:  # noqa: BLE001
        return f"no ({type(err).__name__})"
    return "yes"

cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "no CUDA"
names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
te = imports("transformer_engine.pytorch") if importlib.util.find_spec("transformer_engine") else "no (not installed)"
print(f"env   torch {torch.__version__} ({cuda}{': ' + names if names else ''}); "
      f"megatron-core {md.version('megatron-core')}; transformer_engine {te}; "
      f"apex fused_weight_gradient_mlp_cuda {imports('fused_weight_gradient_mlp_cuda')}")
EOF

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
LOG=${LOG:-$(mktemp "${TMPDIR:-/tmp}/gpu-smoke-XXXXXX.log")}
"$PY" -m pytest tests/gpu/test_gpu_single.py tests/gpu/test_gpu_colocation.py tests/gpu/test_gpu_context_parallel.py tests/gpu/test_gpu_parity.py -q -rA -p no:cacheprovider -o timeout=1800 -o junit_family=xunit1 \
  --junitxml="$WORK/report.xml" >"$LOG" 2>&1
status=$?

"$PY" - "$WORK/report.xml" "$status" "$LOG" <<'EOF'
"""Turn pytest's JUnit XML into verdict lines; exit 1 on any failure or a broken run."""
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

report, status, log = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

def one_line(text, limit=300):
    text = " ".join((text or "").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."

if not report.exists():
    print(f"FAIL  pytest  no report (exit {status}); see {log}")
    sys.exit(1)
failed, count = False, 0
for case in ET.parse(report).getroot().iter("testcase"):
    count += 1
    module = case.get("classname", "").rsplit(".", 1)[-1].removeprefix("test_")
    name = f"{module}::{case.get('name', '').removeprefix('test_')}"
    figure = " ".join(p.get("value", "") for p in case.iter("property") if p.get("name") == "figure")
    problem = case.find("failure")
    problem = case.find("error") if problem is None else problem
    skipped = case.find("skipped")
    if problem is not None:
        failed = True
        print(f"FAIL  {name}  {one_line(problem.get('message'))}")
    elif skipped is not None:
        print(f"SKIP  {name}  {one_line(skipped.get('message'))}")
    else:
        print(f"PASS  {name}  {one_line(figure, 400)}")
if count == 0 or status not in (0, 1):
    print(f"FAIL  pytest  exit {status} with {count} test(s) reported; see {log}")
    sys.exit(1)
print(f"(pytest output: {log})")
sys.exit(1 if failed else 0)
EOF
