#!/usr/bin/env bash
# A/B of one trace replay: the same trace, before (BEFORE: a checkout of the code before a
# change) and after (this checkout), each side run from inside its own checkout (`python -m` puts the working
# directory first on sys.path), one after the other on a quiet machine.
#   BEFORE=/work/before TRACE=short_turns OUT=/tmp/trace_ab benchmarks/trace_ab.sh
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$HERE/.venv/bin/python}"
TRACE="${TRACE:-short_turns}"
OUT="${OUT:-/tmp/trace_ab}"
METHODS="${METHODS:-nonshared,fullshared,prelrshared}"
mkdir -p "$OUT"
for side in before after; do
  dir="$HERE"; [ "$side" = before ] && dir="$BEFORE"
  (cd "$dir" && HF_HUB_OFFLINE=1 "$PY" -m precache.cli bench trace --trace "$TRACE" --methods "$METHODS" \
     --repeats 3 --threads 2 --json "$OUT/${TRACE}_$side.json" --markdown "$OUT/${TRACE}_$side.md")
done
