"""The GPU benchmark's report: ``gpu.json`` (everything), ``gpu.md`` (tables and targets) and
``gpu.png`` (kernel/SDPA time ratios, TTFT per turn on the trace, throughput under load)."""

from __future__ import annotations

import json
from pathlib import Path

from precache.bench.report import trace_markdown


def _yes(flag: bool) -> str:
    return "met" if flag else "NOT met"


def _not_measured(part: dict) -> list[str]:
    """A part that did not run: its error, or why it was skipped."""
    return [f"Not measured: {part.get('error') or part.get('skipped')}.", ""]


def _kernel_md(kernel: dict) -> list[str]:
    if "cases" not in kernel:
        return ["## 1. Triton kernel vs SDPA (same lengths)", "", *_not_measured(kernel)]
    lines = [
        "## 1. Triton kernel vs SDPA (same lengths)",
        "",
        f"Target: kernel time with LR terms <= {kernel['target_ratio']}x SDPA's: **{_yes(kernel['met'])}**.",
        "",
        "| case | LR | queries | keys | batch | kernel ms | SDPA ms | ratio | max abs err vs torch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in kernel["cases"]:
        lines.append(
            f"| {c['kind']} | {c['lr']} | {c['queries']:,} | {c['keys']:,} | {c['batch']} | "
            f"{c['kernel_s'] * 1e3:.3f} | {c['sdpa_s'] * 1e3:.3f} | {c['ratio']:.2f} | "
            f"{c['max_abs_error_vs_torch_backend']:.2e} |"
            + (" torch reference: " + "; ".join(c["refused"]) if c.get("refused") else "")
        )
    if any(c.get("refused") for c in kernel["cases"]):
        lines += ["", "A row marked 'torch reference' was refused by the kernel and timed the reference."]
    return [*lines, ""]


def _trace_md(traces: dict) -> list[str]:
    lines = ["## 2. Trace replay", ""]
    for name, result in traces.items():
        lines.append(f"### adapters: {name}")
        lines.append("")
        if "methods" not in result:
            lines += _not_measured(result)
            continue
        t = result["ttft_target"]
        lines += [
            trace_markdown(result),
            f"PreLRShared TTFT speed-up over NonShared: {t['prelrshared_ttft_speedup']:.2f}x; prefill-token "
            f"ceiling {t['prefill_token_ceiling']:.2f}x; fraction {t['fraction_of_ceiling']:.2f} "
            f"(target >= {t['target']}: **{_yes(t['met'])}**).",
            "",
        ]
        lines += [f"Skipped: {s}" for s in result.get("skipped", [])]
    return lines


def _load_md(load: dict) -> list[str]:
    if "levels" not in load:
        return ["## 3. Concurrent trajectories", "", *_not_measured(load)]
    lines = [
        f"## 3. Concurrent trajectories (trace `{load['trace']}`, {load['trace_tokens']} tokens each)",
        "",
        "| trajectories | method | throughput tok/s | p50 TTFT ms | p90 TTFT ms | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for level, methods in load["levels"].items():
        for method, r in methods.items():
            lines.append(
                f"| {level} | {method} | {r['throughput_tok_s']:.0f} | {r['p50_ttft_s'] * 1e3:.1f} | "
                f"{r['p90_ttft_s'] * 1e3:.1f} | {r['wall_s']:.1f} |"
            )
    lines.append("")
    for level, ratio in load["db_over_lp_throughput"].items():
        lines.append(f"ReBaseShared DB / LP throughput at {level} trajectories: {ratio:.2f}x.")
    lines += [f"Skipped: {s}" for s in load["skipped"]]
    return [*lines, ""]


def markdown(result: dict) -> str:
    m = result["machine"]
    head = [
        "# precache GPU benchmark"
        + (" (DRY RUN: tiny config on CPU, numbers mean nothing)" if result["dry_run"] else ""),
        "",
        f"Machine: {m.get('gpu', m['device'])}, torch {m['torch']}, triton {m['triton']}, CUDA {m.get('cuda')}. "
        f"Model: {result['model']}. Run time {result['seconds']:.0f} s.",
        "",
    ]
    return "\n".join(
        head + _kernel_md(result["kernel"]) + _trace_md(result["trace"]) + _load_md(result["load"])
    )


def plot(result: dict, path: Path) -> None:
    """Three panels: kernel/SDPA ratio per case, TTFT per turn (q/v adapters), throughput under load."""
    from precache.bench.plots import plt, save_figure  # matplotlib: only to draw

    fig, (ax_k, ax_t, ax_l) = plt.subplots(1, 3, figsize=(17, 4.5))
    cases = result["kernel"].get("cases", [])
    labels = [f"{c['kind'][0]}{c['queries']}/{c['keys']}x{c['batch']} {c['lr']}" for c in cases]
    ax_k.bar(range(len(cases)), [c["ratio"] for c in cases])
    ax_k.axhline(result["kernel"].get("target_ratio", 1.15), color="red", linestyle="--", label="target")
    ax_k.set_xticks(range(len(cases)), labels, rotation=90, fontsize=6)
    ax_k.set(ylabel="kernel time / SDPA time", title="Triton kernel vs SDPA")
    ax_k.legend(fontsize=8)
    trace = next((r for r in result["trace"].values() if "methods" in r), None)
    if trace is not None:
        for name, entry in trace["methods"].items():
            ax_t.plot([t * 1e3 for t in entry["turns"]["ttft_s"]], marker="o", markersize=3, label=name)
        ax_t.set(xlabel="turn", ylabel="TTFT (ms)", yscale="log", title=f"TTFT per turn, {trace['trace']}")
        ax_t.legend(fontsize=7)
    by_level = result["load"].get("levels", {})
    for method in next(iter(by_level.values()), {}):
        levels = [lv for lv, r in by_level.items() if method in r]
        values = [by_level[lv][method]["throughput_tok_s"] for lv in levels]
        ax_l.plot([int(lv) for lv in levels], values, marker="o", label=method)
    ax_l.set(xlabel="concurrent trajectories", ylabel="tokens/s", title="throughput under load")
    ax_l.legend(fontsize=7)
    for ax in (ax_k, ax_t, ax_l):
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def write_report(result: dict, out: Path) -> None:
    """``gpu.json``, ``gpu.md`` and (when matplotlib is installed) ``gpu.png`` under ``out``."""
    (out / "gpu.json").write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
    (out / "gpu.md").write_text(markdown(result), encoding="utf-8")
    try:
        plot(result, out / "gpu.png")
    except ImportError as exc:  # matplotlib missing on this machine: say so in the markdown
        with (out / "gpu.md").open("a", encoding="utf-8") as f:
            f.write(f"\nNo plot: {exc}\n")
