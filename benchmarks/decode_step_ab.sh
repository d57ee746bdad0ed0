#!/usr/bin/env bash
# A/B of the decode step profile (benchmarks/decode_profile.py): BEFORE (a checkout of the
# code before a change) against this checkout, interleaved REPEATS times, each side importing its
# own package (PYTHONPATH), on a quiet machine. Prints each run's markdown table.
#   BEFORE=/work/before OUT=/tmp/step_ab benchmarks/decode_step_ab.sh
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$HERE/.venv/bin/python}"
OUT="${OUT:-/tmp/step_ab}"
REPEATS="${REPEATS:-3}"
ARGS="${ARGS:---methods nonshared,fullshared,prelrshared --batch 1,16 --steps 32 --threads 2}"
mkdir -p "$OUT"
for r in $(seq "$REPEATS"); do
  for side in before after; do
    dir="$HERE"; [ "$side" = before ] && dir="$BEFORE"
    # shellcheck disable=SC2086
    PYTHONPATH="$dir" HF_HUB_OFFLINE=1 "$PY" "$HERE/benchmarks/decode_profile.py" $ARGS \
      | tee "$OUT/${side}_$r.md"
  done
done
