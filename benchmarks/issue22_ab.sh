#!/usr/bin/env bash
# Issue 22 A/B: the same trace, before (BEFORE: a checkout of the code before the decode work) and
# after (this checkout), each side run from inside its own checkout (`python -m` puts the working
# directory first on sys.path), one after the other on a quiet machine.
#   BEFORE=/work/before TRACE=short_turns OUT=/tmp/ab22 benchmarks/issue22_ab.sh
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$HERE/.venv/bin/python}"
TRACE="${TRACE:-short_turns}"
OUT="${OUT:-/tmp/ab22}"
METHODS="${METHODS:-nonshared,fullshared,prelrshared}"
mkdir -p "$OUT"
for side in before after; do
  dir="$HERE"; [ "$side" = before ] && dir="$BEFORE"
  (cd "$dir" && HF_HUB_OFFLINE=1 "$PY" -m precache.cli bench trace --trace "$TRACE" --methods "$METHODS" \
     --repeats 3 --threads 2 --json "$OUT/${TRACE}_$side.json" --markdown "$OUT/${TRACE}_$side.md")
done
