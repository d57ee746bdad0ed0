#!/usr/bin/env bash
# Old code against new in one run on a quiet machine (the no-regression check of a change): TTFT
# and decode of paper_L1024 and short_turns (PreLRShared and the NonShared reference, 3 repeats),
# the 32-conversation server load (3 repeats), and the livelock case (16 requests on a 76-block pool, 3 repeats; a side that
# does not answer every request by the deadline stops there).
# Usage: OLD=<checkout of the old code> [DEADLINE=450] [PARTS="L1024 short serve livelock"] benchmarks/regression_ab.sh [OUT]
# (PARTS: the measurements to run, all four by default)
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${OLD:?set OLD to a checkout of the code before the change}
OUT=$(realpath -m "${1:-benchmarks/results/regression_ab}")
HERE=$PWD
PY=$HERE/.venv/bin/python
export HF_HUB_OFFLINE=1
mkdir -p "$OUT"
PARTS=" ${PARTS:-L1024 short serve livelock} "
for side in old new; do
  if [ "$side" = old ]; then SRC=$(realpath "$OLD"); else SRC=$HERE; fi
  # run inside the side's checkout: `python -m` puts the working directory first on sys.path, so
  # from anywhere else the editable install's (or the caller's) precache would be imported
  run() { (cd "$SRC" && PYTHONPATH=$SRC "$PY" "$@"); }
  [[ $PARTS != *" L1024 "* ]] || run -m precache.cli bench trace --trace paper_L1024 --adapters qv --methods prelrshared --no-hf-peft \
    --repeats 3 --threads 2 --json "$OUT/trace_L1024_$side.json"
  [[ $PARTS != *" short "* ]] || run -m precache.cli bench trace --trace short_turns --adapters qv --methods prelrshared --no-hf-peft \
    --repeats 3 --threads 2 --json "$OUT/trace_short_$side.json"
  for seed in 1 2 3; do
    [[ $PARTS != *" serve "* ]] || run -m precache.cli bench serve --adapters qv --methods prelrshared --qps 4 --sessions 32 \
      --seed $seed --json "$OUT/serve32_${side}_$seed.json"
  done
  [[ $PARTS != *" livelock "* ]] || run "$HERE/benchmarks/livelock.py" --requests 16 --repeats 3 --deadline "${DEADLINE:-450}" | tee "$OUT/livelock_$side.jsonl"
done
"$PY" "$HERE/benchmarks/regression_ab_report.py" "$OUT"
