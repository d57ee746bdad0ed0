"""Tables of `bench trace` JSON files (`benchmarks/trace_vs_llama_cpp.sh`,
`decode_compiled_vs_llama_cpp.sh`): per method and baseline, min / median / max over the repeats of
sum TTFT, latency and decode tokens/s, and PreLRShared's ratios to the others per repeat.

    python benchmarks/trace_report.py benchmarks/results/llama_cpp_paper_L1024_fp32.json ...
"""

from __future__ import annotations

import json
import statistics
import sys


def spread(values, fmt="{:.2f}"):
    xs = sorted(values)
    return " / ".join(fmt.format(x) for x in (xs[0], statistics.median(xs), xs[-1]))


def report(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    cfg = d.get("config", {})
    out = [
        f"`{path}`: trace {d['trace']}, dtype {cfg.get('dtype') or 'float32'}"
        f"{', int8 weights' if cfg.get('quantization') else ''}{', --compile-decode' if cfg.get('compile_decode') else ''}{', eager' if cfg.get('eager') else (', compiled decode step' if 'eager' in cfg else '')}, {d['repeats']} repeats "
        f"(min / median / max)",
        "",
        "| method | sum TTFT (s) | sum latency (s) | decode (tok/s) | prefill tokens | peak KV (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in d["methods"].items():
        runs = entry["runs"]
        out.append(
            f"| {name} | {spread([r['ttft_s'] for r in runs])} | {spread([r['latency_s'] for r in runs])} | "
            f"{spread([r['decode_tok_s'] for r in runs], '{:.1f}')} | {int(runs[0]['prefill_tokens']):,} | "
            f"{runs[0]['peak_kv_bytes'] / 2**20:.1f} |"
        )
    m = d["methods"]
    if {"prelrshared", "fullshared", "nonshared"} <= set(m):
        pre, full, non = (m[k]["runs"] for k in ("prelrshared", "fullshared", "nonshared"))
        rows = [
            (
                "PreLRShared / FullShared decode tok/s",
                [p["decode_tok_s"] / f["decode_tok_s"] for p, f in zip(pre, full, strict=True)],
            ),
            (
                "PreLRShared / FullShared sum TTFT",
                [p["ttft_s"] / f["ttft_s"] for p, f in zip(pre, full, strict=True)],
            ),
            (
                "NonShared / PreLRShared sum TTFT (speed-up)",
                [n["ttft_s"] / p["ttft_s"] for n, p in zip(non, pre, strict=True)],
            ),
        ]
        for base in ("llama-cpp-f32", "llama-cpp-q8_0", "llama-cpp-q4_0"):
            if base in m:
                rows.append(
                    (
                        f"{base} / PreLRShared sum latency",
                        [b["latency_s"] / p["latency_s"] for b, p in zip(m[base]["runs"], pre, strict=True)],
                    )
                )
                for name in [k for k in m if not k.startswith(("llama-cpp", "hf-peft"))]:
                    rows.append(
                        (
                            f"{name} / {base} decode tok/s",
                            [
                                r["decode_tok_s"] / b["decode_tok_s"]
                                for b, r in zip(m[base]["runs"], m[name]["runs"], strict=True)
                            ],
                        )
                    )
        out += [
            "",
            "| ratio, per repeat (same round) | repeat 1 | repeat 2 | repeat 3 |",
            "|---|---|---|---|",
        ]
        for label, values in rows:
            out.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    print("\n\n".join(report(p) for p in sys.argv[1:]))
