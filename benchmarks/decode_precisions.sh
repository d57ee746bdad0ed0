#!/usr/bin/env bash
# Batch-1 decode of the compiled step per weight precision and KV-cache dtype, on a quiet machine,
# 2 threads, 3 interleaved repeats (min / median / max in RESULTS.md): fp32, int8 and int4 weights
# at 256 tokens of context, then fp32 against a bf16 KV cache at 256 and 4,096 tokens (the
# cache read grows with the context; at 4,096 it is about 190 MB a step at fp32). Each bench decode
# run measures the compiled engine, the eager engine and HF + PEFT side by side; last, 16
# trajectories at fp32.
set -euo pipefail
P="${PRECACHE:-.venv/bin/precache}"
OUT="${OUT:-benchmarks/results/decode_precisions}"
mkdir -p "$OUT"
run() {  # name, prompt length, trajectories, options...
  local name=$1 len=$2 c=$3
  shift 3
  "$P" bench decode --concurrency "$c" --prompt-len "$len" --new-tokens 64 --method prelrshared "$@" \
    --repeats 3 --threads 2 --json "$OUT/$name.json" --markdown "$OUT/$name.md"
}
run fp32_L256 256 1
run int8_L256 256 1 --quantization int8
run int4_L256 256 1 --quantization int4
run kvbf16_L256 256 1 --kv-cache-dtype bfloat16
run fp32_L4096 4096 1
run kvbf16_L4096 4096 1 --kv-cache-dtype bfloat16
run fp32_c16_L256 256 16
