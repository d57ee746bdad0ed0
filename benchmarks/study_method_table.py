"""The method table of a study report (issue 23's summary): per point, the methods the issue
compares (agreement with NonShared, turn match, teacher-forced KL and K errors, prefill tokens,
prefill per turn of the free runs, KV MiB), its targets, and the sign tests of ReBaseOwnShared-LP
against PreLRShared and ReBaseShared-LP. Reads ``study.json`` (``precache study ... --report-only``) and the stored
questions for the per-turn prefill; prints markdown.

    .venv/bin/python benchmarks/study_method_table.py benchmarks/results/study
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

METHODS = (
    "nonshared",
    "prelrshared",
    "rebaseshared-lp",
    "rebaseownshared-lp",
    "cacheblend",
    "droidspeak",
    "relaycaching",
    "fullshared",
)


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def turns_of(folder: Path, method: str, ids: set[str]) -> int:
    """Free-run turns of ``method`` summed over the stored questions ``ids``."""
    total = 0
    for path in folder.glob("*.json.gz"):
        entry = json.loads(gzip.decompress(path.read_bytes()))
        if entry["id"] in ids:
            total += entry["methods"][method]["turns"]
    return total


def main(out: Path) -> None:
    study = json.loads((out / "study.json").read_text())
    for key, run in study["runs"].items():
        table = run["table"]
        if "rebaseownshared-lp" not in table:
            continue
        folder = out / "questions" / key.replace("/", "-") / "scale-1.0"
        ids = set()
        for path in folder.glob("*.json.gz"):
            entry = json.loads(gzip.decompress(path.read_bytes()))
            if all(
                m in entry["methods"] and "revision" in entry["methods"].get("cacheblend", {})
                for m in METHODS
            ):
                ids.add(entry["id"])
        print(f"### {key} ({run['questions']} questions)\n")
        print(
            "| method | agreement | turn_match | first_kl | mean_kl | k_error_own | k_error_other "
            "| prefill_tokens | prefill / turn | KV MiB |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for m in METHODS:
            row = table[m]
            per_turn = row["prefill_tokens"] / max(1, turns_of(folder, m, ids))
            kv = None if row.get("kv_bytes") is None else row["kv_bytes"] / 2**20
            own, other = row["k_error_own"], row["k_error_other"]
            print(
                f"| {m} | {fmt(row['agreement'])} | {fmt(row['turn_match'])} | {fmt(row['first_kl'])} "
                f"| {fmt(row['mean_kl'])} | {fmt(own)} | {fmt(other)} | {row['prefill_tokens']} "
                f"| {per_turn:.1f} | {fmt(kv, 1)} |"
            )
        best = max(table["prelrshared"]["agreement"], table["rebaseshared-lp"]["agreement"])
        own = table["rebaseownshared-lp"]
        print(
            f"\n- agreement, ReBaseOwnShared-LP {own['agreement']:.3f} against the better of PreLRShared "
            f"and ReBaseShared-LP {best:.3f}: {'met' if own['agreement'] >= best else 'missed'}"
        )
        ratio = own["prefill_tokens"] / table["rebaseshared-lp"]["prefill_tokens"]
        print(f"- free-run prefill tokens against ReBaseShared-LP: {ratio:.2f}x")
        ds = table["droidspeak"]["prefill_tokens"] / table["nonshared"]["prefill_tokens"]
        print(f"- DroidSpeak prefill against NonShared: {ds:.2f}x")
        for other, pairs in (run.get("paired_own") or {}).items():
            for measure, c in pairs.items():
                print(
                    f"- ReBaseOwnShared-LP against {other}, {measure}: higher on {c['better']}, lower on "
                    f"{c['worse']} (p = {c['p']:.3g})"
                )
        print()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/study"))
