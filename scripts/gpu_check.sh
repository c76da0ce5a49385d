#!/usr/bin/env bash
# The GPU check in one command, on the machine's own python3 (no uv, no registry, nothing
# installed): verst is imported from the packages' src folders. See scripts/gpu_check.py for the
# stages, their budgets and the files written to OUT ($OUT, else --out, else gpu-check-out).
#
# Usage: scripts/gpu_check.sh [--out DIR] [--only kernels,engine,fsdp,grpo,sglang] [--budget-s 480]
#                             [--sglang-server sglang|verst] [--extra-path DIR]
#   PYTHON=python3.11 scripts/gpu_check.sh ...   another interpreter (default: python3)
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=$(printf '%s:' "$PWD"/packages/*/src)
export PYTHONPATH="${SRC%:}${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
