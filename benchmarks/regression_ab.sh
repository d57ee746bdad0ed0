#!/usr/bin/env bash
# Old code against new in one run on a quiet machine (the no-regression check of a change), in
# three interleaved rounds (old, new, old, new, ...): TTFT and decode of paper_L1024 and short_turns
# (PreLRShared and the NonShared reference), the 32-conversation server load, and the livelock case (16 requests on a 76-block pool, 3 repeats; a side that
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
side_src() { if [ "$1" = old ]; then realpath "$OLD"; else echo "$HERE"; fi; }
# run inside the side's checkout: `python -m` puts the working directory first on sys.path, so
# from anywhere else the editable install's (or the caller's) precache would be imported
run() { local src; src=$(side_src "$1"); shift; (cd "$src" && PYTHONPATH=$src "$PY" "$@"); }
# three rounds, each running the old side then the new one: the machine's drift over the run
# falls on both sides (a side run whole after the other was not separable from drift)
for round in 1 2 3; do
  for side in old new; do
    [[ $PARTS != *" L1024 "* ]] || run $side -m precache.cli bench trace --trace paper_L1024 --adapters qv \
      --methods prelrshared --no-hf-peft --repeats 1 --threads 2 --json "$OUT/trace_L1024_${side}_$round.json"
    [[ $PARTS != *" short "* ]] || run $side -m precache.cli bench trace --trace short_turns --adapters qv \
      --methods prelrshared --no-hf-peft --repeats 1 --threads 2 --json "$OUT/trace_short_${side}_$round.json"
    [[ $PARTS != *" serve "* ]] || run $side -m precache.cli bench serve --adapters qv --methods prelrshared --qps 4 \
      --sessions 32 --seed $round --json "$OUT/serve32_${side}_$round.json"
  done
done
for side in old new; do
  [[ $PARTS != *" livelock "* ]] || run $side "$HERE/benchmarks/livelock.py" --requests 16 --repeats 3 --deadline "${DEADLINE:-450}" | tee "$OUT/livelock_$side.jsonl"
done
"$PY" "$HERE/benchmarks/regression_ab_report.py" "$OUT"
