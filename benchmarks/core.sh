#!/usr/bin/env bash
# The engine-core benchmarks of RESULTS.md, one after another on a quiet machine (2 torch threads).
# Usage: benchmarks/core.sh [OUT]   (default OUT: benchmarks/results)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
P=.venv/bin/precache
ALL=nonshared,fullshared,baseshared,prelrshared,rebaseshared-lp,rebaseshared-db
export HF_HUB_OFFLINE=1
mkdir -p "$OUT"
rm -f $OUT/eval_wall.txt
$P bench trace --trace paper_L1024 --adapters qv --methods $ALL --repeats 2 --threads 2 \
  --json $OUT/trace_L1024_qv_t2.json --markdown $OUT/trace_L1024_qv_t2.md --plot $OUT/trace_L1024_qv_t2.png
$P bench trace --trace short_turns --adapters qv --methods $ALL --repeats 3 --threads 2 \
  --json $OUT/trace_short_qv_t2.json --markdown $OUT/trace_short_qv_t2.md --plot $OUT/trace_short_qv_t2.png
$P bench episodes --limit 20 --adapters qv --methods nonshared,fullshared,prelrshared,rebaseshared-lp \
  --concurrency 4 --threads 2 --json $OUT/episodes_qv_t2.json --markdown $OUT/episodes_qv_t2.md
$P bench decode --concurrency 16 --prompt-len 256 --new-tokens 64 --adapters qv --threads 2 \
  --json $OUT/decode_c16_qv_t2.json --markdown $OUT/decode_c16_qv_t2.md
$P bench capacity --kv-cache-bytes 2147483648 --paper-len 256 --adapters qv \
  --methods nonshared,fullshared,prelrshared --threads 2 \
  --json $OUT/capacity_L256_qv.json --markdown $OUT/capacity_L256_qv.md
for c in 1 8; do
  start=$(date +%s.%N)
  $P eval --split dev --limit 20 --adapters qv --method prelrshared --concurrency $c --json $OUT/eval_prelr_c$c.json
  echo "eval --concurrency $c: $(echo "$(date +%s.%N) - $start" | bc) s wall" | tee -a $OUT/eval_wall.txt
done
