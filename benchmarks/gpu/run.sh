#!/usr/bin/env bash
# The prepared GPU benchmark of issue 14 (precache/bench/gpu.py): the Triton kernel against SDPA,
# the paper's trace paper_L4096 for every method and HF + PEFT, and 32-128 concurrent trajectories,
# on a randomly initialised Llama-3.1-8B-shaped model in bf16 (no downloads). Under 8 minutes on
# one H200 (a time budget skips what would not fit, and says so).
#
#   bash benchmarks/gpu/run.sh [--out DIR] [--dry-run] [--budget-s SECONDS]
#
# --dry-run: the same script on CPU with a tiny config and tiny lengths, the kernel in Triton's
# interpreter (seconds; the numbers mean nothing). Python: $PYTHON, else .venv/bin/python, else python3.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$ROOT/benchmarks/results/gpu"
ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --dry-run) ARGS+=(--dry-run); export TRITON_INTERPRET=1; shift ;;
    --budget-s) ARGS+=(--budget-s "$2"); shift 2 ;;
    *) echo "run.sh: unknown argument '$1' (use --out DIR, --dry-run, --budget-s S)" >&2; exit 2 ;;
  esac
done
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"
else PY=python3; fi
export HF_HUB_OFFLINE=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
exec "$PY" -m precache.bench.gpu --out "$OUT" "${ARGS[@]}"
