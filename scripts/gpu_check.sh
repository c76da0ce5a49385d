#!/usr/bin/env bash
# The GPU check: what only a GPU and a real SGLang 0.5.23 server can show, in one command.
#
# Why: the default test suite runs on CPU (Triton under TRITON_INTERPRET, `verst serve` standing
# in for SGLang). This script runs, on one GPU box from a fresh clone (only package registries
# reachable, no model download: it saves a tiny random model locally):
#   kernels  compiled Triton kernels vs float64 at T=32,768 x V=151,936 bf16 (past 2^31
#            elements), their time vs the measured copy bandwidth, a [B,T+1,V][:, :-1] slice read
#            in place, the OPD backward with 16 target ids per row (registers, spills); the
#            embedded engine's grouped-query attention vs SDPA (fp32, bf16) and its decode time;
#   sglang   two real SGLang servers on GPU 0 (memory saver + weights CPU backup; the second with
#            --enable-deterministic-inference) and the client against them: the client test
#            suite, log-probs vs HF, "default" version, exact-rid abort, refit from disk /
#            tensors (CUDA IPC, buckets) / distributed (gloo group built like SGLang's, buckets)
#            inside weight-update sessions, NCCL refused on a shared GPU, release/resume keeps
#            weights, the colocated release -> refit -> resume order, seeded sampling;
#   router   sglang-router 0.3.2 in front of both: GET /workers, generate, abort, refit.
# It writes OUT/summary.txt (one PASS/FAIL/SKIP line per check, then a total) and exits non-zero
# on any FAIL. Budget: <= 8 minutes on one H200 (sync ~2-3 min cold, kernels ~1 min, servers and
# checks ~3 min).
#
# Usage: scripts/gpu_check.sh [--out DIR] [--only kernels,sglang] [--skip-sync] [--server verst]
#                             [--dry-run]
#   --out DIR       where the model, logs and summary go (default: gpu-check-out)
#   --only LIST     comma-separated subset of: kernels, sglang (sglang includes the router)
#   --skip-sync     do not run `pip install uv` / `uv sync --extra sglang`
#   --server verst  run the sglang checks against `verst serve` instead (a CPU rehearsal)
#   --dry-run       parse arguments, save the tiny model, print the plan; no GPU needed
set -euo pipefail

OUT=gpu-check-out
ONLY=kernels,sglang
SYNC=1
SERVER=sglang
DRY=0
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) OUT=${2:?--out needs a directory}; shift 2 ;;
        --only) ONLY=${2:?--only needs a list}; shift 2 ;;
        --skip-sync) SYNC=0; shift ;;
        --server) SERVER=${2:?--server needs sglang or verst}; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$SERVER" in sglang|verst) ;; *) echo "gpu_check.sh: --server must be sglang or verst, got '$SERVER'" >&2; exit 2 ;; esac
IFS=',' read -r -a PARTS <<<"$ONLY"
for part in "${PARTS[@]}"; do
    case "$part" in kernels|sglang) ;; *) echo "gpu_check.sh: --only takes kernels,sglang; got '$part'" >&2; exit 2 ;; esac
done
wants() { [[ ",$ONLY," == *",$1,"* ]]; }

cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
START=$(date +%s)
echo "gpu_check: out=$OUT only=$ONLY server=$SERVER sync=$SYNC dry_run=$DRY"

if [[ $SYNC == 1 && $DRY == 0 ]]; then
    command -v uv >/dev/null || python3 -m pip install --quiet uv
    EXTRA=(--extra sglang)
    [[ $SERVER == verst ]] && EXTRA=()
    uv sync "${EXTRA[@]}"
fi
command -v uv >/dev/null || { echo "gpu_check.sh: uv is not installed (python3 -m pip install uv)" >&2; exit 2; }

uv run python scripts/gpu_checks.py model "$OUT/model"
if [[ $DRY == 1 ]]; then
    echo "dry run: model saved to $OUT/model; would run: ${PARTS[*]} (server: $SERVER)"
    exit 0
fi

if [[ $SERVER == sglang ]]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    uv run python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
fi
status=0
if wants kernels && [[ $SERVER == sglang ]]; then
    uv run python scripts/gpu_checks.py kernels --summary "$SUMMARY" || status=1
fi
if wants sglang; then
    if [[ $SERVER == sglang ]]; then
        uv run python -c "import sglang, sglang_router" || { echo "FAIL sglang/import: uv sync --extra sglang" >>"$SUMMARY"; status=1; }
    fi
    uv run python scripts/gpu_checks.py sglang --model "$OUT/model" --summary "$SUMMARY" \
        --server "$SERVER" --logs "$OUT/logs" || status=1
fi

passed=$(grep -c '^PASS' "$SUMMARY" || true)
failed=$(grep -c '^FAIL' "$SUMMARY" || true)
skipped=$(grep -c '^SKIP' "$SUMMARY" || true)
echo "gpu_check: ${passed} passed, ${failed} failed, ${skipped} skipped in $(( $(date +%s) - START ))s" | tee -a "$SUMMARY"
echo "summary: $SUMMARY"
[[ $failed == 0 && $status == 0 ]]
