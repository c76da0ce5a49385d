#!/usr/bin/env bash
# Check the SGLang client against a REAL SGLang server (needs a GPU and `uv sync --extra sglang`).
#
# Why: the client tests normally run against `verst serve` (the embedded engine behind SGLang's
# API). This script starts `python -m sglang.launch_server` on a small model and runs the same
# test module against it (tests that kill or stand in for verst serve processes skip).
#
# Usage: scripts/gpu_check_sglang.sh MODEL_DIR [PORT]
#   MODEL_DIR: a small HF model directory the server can load (e.g. a 0.5B instruct model).
# Not run in CI: the development machine has no GPU.
set -euo pipefail

MODEL=${1:?usage: scripts/gpu_check_sglang.sh MODEL_DIR [PORT]}
PORT=${2:-30123}
URL="http://127.0.0.1:${PORT}"
LOG=$(mktemp -t sglang-check-XXXX.log)
cd "$(dirname "$0")/.."

uv run python -c "import sglang" 2>/dev/null || { echo "sglang is not installed: uv sync --extra sglang" >&2; exit 2; }

uv run python -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --mem-fraction-static 0.5 >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; sleep 3; kill -9 $SERVER 2>/dev/null || true' EXIT

echo "waiting for $URL/health_generate (log: $LOG)"
for _ in $(seq 1 600); do
    if curl -sf "$URL/health_generate" >/dev/null; then break; fi
    if ! kill -0 $SERVER 2>/dev/null; then echo "sglang exited:" >&2; tail -50 "$LOG" >&2; exit 1; fi
    sleep 1
done
curl -sf "$URL/health_generate" >/dev/null || { echo "not ready after 600 s" >&2; tail -50 "$LOG" >&2; exit 1; }

VERST_TEST_SGLANG_URL="$URL" VERST_TEST_SGLANG_MODEL="$MODEL" \
    uv run pytest -q tests/engines/test_engine_sglang_client.py -p no:cacheprovider "${@:3}"
