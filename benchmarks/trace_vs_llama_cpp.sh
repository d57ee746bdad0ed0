#!/usr/bin/env bash
# precache's trace replay against llama.cpp's llama-server with the eager engine's settings of
# issue 22 (needs `make llama-cpp`), on a quiet machine, 2 threads: every side of each table in
# one `bench trace` run, 3 repeats (min / median / max in RESULTS.md; tables by
# `python benchmarks/trace_report.py <json>`).
set -euo pipefail
P="${PRECACHE:-.venv/bin/precache}"
OUT="${OUT:-benchmarks/results}"
M=nonshared,fullshared,prelrshared
for trace in paper_L1024 short_turns; do
  "$P" bench trace --trace "$trace" --adapters qv --methods $M --baselines hf-peft,llama-cpp \
    --repeats 3 --threads 2 --json "$OUT/llama_cpp_${trace}_fp32.json"
done
"$P" bench trace --trace paper_L1024 --adapters qv --methods $M --dtype bfloat16 \
  --baselines llama-cpp-q8_0,llama-cpp-q8_0-1slot --repeats 3 --threads 2 \
  --json "$OUT/llama_cpp_paper_L1024_bf16.json"
# int8 weight-only (precache --quantization int8) against llama.cpp q8_0 and f32, one slot per agent
for trace in short_turns paper_L1024; do
  "$P" bench trace --trace "$trace" --adapters qv --methods $M --quantization int8 \
    --baselines llama-cpp-q8_0,llama-cpp-f32 --repeats 3 --threads 2 \
    --json "$OUT/llama_cpp_${trace}_int8.json"
done
