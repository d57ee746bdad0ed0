#!/usr/bin/env bash
# The compiled decode step (issue 34) measured on a quiet machine, 2 threads, 3 interleaved repeats
# per table (min / median / max in RESULTS.md): bench decode (compiled, eager and HF + PEFT in
# one run, with ms a step and GB/s against the machine's read bandwidth) at 1 and 16 trajectories,
# then bench trace on short_turns with llama.cpp at f32, q8_0 and q4_0 in the same run (needs
# `make llama-cpp`), at fp32 and with int8 weights.
set -euo pipefail
P="${PRECACHE:-.venv/bin/precache}"
OUT="${OUT:-benchmarks/results/compiled_decode}"
mkdir -p "$OUT"
for c in 1 16; do
  "$P" bench decode --concurrency "$c" --prompt-len 256 --new-tokens 64 --method prelrshared \
    --repeats 3 --threads 2 --json "$OUT/decode_c${c}_fp32.json" --markdown "$OUT/decode_c${c}_fp32.md"
done
for precision in "--quantization int8" "--dtype bfloat16"; do
  name=${precision##* }
  "$P" bench decode --concurrency 1 --prompt-len 256 --new-tokens 64 --method prelrshared $precision \
    --repeats 3 --threads 2 --json "$OUT/decode_c1_${name}.json" --markdown "$OUT/decode_c1_${name}.md"
done
M=nonshared,fullshared,prelrshared,rebaseownshared-lp
"$P" bench trace --trace short_turns --adapters qv --methods $M \
  --baselines llama-cpp-f32,llama-cpp-q8_0,llama-cpp-q4_0 --repeats 3 --threads 2 \
  --json "$OUT/short_turns_fp32.json" --markdown "$OUT/short_turns_fp32.md"
"$P" bench trace --trace short_turns --adapters qv --methods $M --quantization int8 \
  --baselines llama-cpp-q8_0 --repeats 3 --threads 2 \
  --json "$OUT/short_turns_int8.json" --markdown "$OUT/short_turns_int8.md"
# the paper trace at fp32 against llama.cpp f32 (its best configuration, one slot per agent)
"$P" bench trace --trace paper_L1024 --adapters qv --methods $M \
  --baselines llama-cpp-f32 --repeats 3 --threads 2 --json "$OUT/paper_L1024_fp32.json" \
  --markdown "$OUT/paper_L1024_fp32.md"
