"""The markdown table of benchmarks/regression_ab.sh's results: min / median / max over the repeats
(a part the run left out, ``PARTS``, has no table)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "n/a"
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def trace_rows(out: Path, name: str) -> list[str]:
    """One row per side and method: the runs of every file of that side (``trace_{name}_{side}.json``
    with all repeats, or one ``trace_{name}_{side}_{round}.json`` per interleaved round)."""
    rows = []
    for side in ("old", "new"):
        files = sorted(out.glob(f"trace_{name}_{side}.json")) + sorted(
            out.glob(f"trace_{name}_{side}_*.json")
        )
        methods: dict[str, list[dict]] = {}
        for path in files:
            for method, m in json.loads(path.read_text())["methods"].items():
                methods.setdefault(method, []).extend(m["runs"])
        for method, runs in methods.items():
            ttft = [r["ttft_s"] for r in runs]
            decode = [r["decode_tok_s"] for r in runs]
            rows.append(f"| {name} | {side} | {method} | {spread(ttft)} | {spread(decode, '{:.1f}')} |")
    return rows


def main(out: Path) -> None:
    print("| trace | code | method | sum TTFT s (min / median / max) | decode tok/s (min / median / max) |")
    print("|---|---|---|---|---|")
    for name in ("L1024", "short"):
        print("\n".join(trace_rows(out, name)))
    if not list(out.glob("serve32_*.json")):
        return
    print()
    print("| code | 32-conversation load: throughput tok/s | TTFT p50 s | errors |")
    print("|---|---|---|---|")
    for side in ("old", "new"):
        runs = [json.loads(p.read_text()) for p in sorted(out.glob(f"serve32_{side}_*.json"))]
        stats = [next(iter(r["methods"]["prelrshared"].values())) for r in runs]
        print(
            f"| {side} | {spread([s['throughput_tok_s'] for s in stats])} | "
            f"{spread([s['ttft_p50_s'] for s in stats], '{:.3f}')} | {sum(s['errors'] for s in stats)} |"
        )
    if not list(out.glob("livelock_*.jsonl")):
        return
    print()
    print("| code | livelock: answered / 16 | 5xx | wall s | tok/s |")
    print("|---|---|---|---|---|")
    for side in ("old", "new"):
        reps = [
            json.loads(line) for line in (out / f"livelock_{side}.jsonl").read_text().splitlines() if line
        ]
        print(
            f"| {side} | {', '.join(str(r['answered']) for r in reps)} | {sum(r['5xx'] for r in reps)} | "
            f"{spread([r['wall_s'] for r in reps], '{:.1f}')} | {spread([r['tokens_per_s'] for r in reps])} |"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/regression_ab"))
