"""Reports: markdown tables and rich tables of trace and fidelity results, JSON files."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rich.table import Table

# (key, header, format of the median) of the trace table; every column also shows the ratio
TRACE_COLUMNS = (
    ("ttft_s", "sum TTFT (s)", "{:.3f}"),
    ("latency_s", "latency (s)", "{:.3f}"),
    ("throughput_tok_s", "throughput (tok/s)", "{:.1f}"),
    ("decode_tok_s", "decode (tok/s)", "{:.1f}"),
    ("peak_kv_bytes", "peak KV (MiB)", "{:.2f}"),
    ("prefill_tokens", "prefill tokens", "{:,.0f}"),
)
FIDELITY_COLUMNS = (
    ("first_kl", "KL first token", "{:.2e}"),
    ("mean_kl", "KL all tokens", "{:.2e}"),
    ("first_top1", "top-1 first", "{:.3f}"),
    ("top1", "top-1 all", "{:.3f}"),
    ("k_error", "K rel. error", "{:.2e}"),
    ("v_error", "V rel. error", "{:.2e}"),
    ("agreement", "answer agreement", "{:.3f}"),
)
#: headers of the benchmarks' accuracy metrics (``Benchmark.metrics``)
METRIC_HEADERS = {"em": "EM", "f1": "F1", "accuracy": "option accuracy"}


def write_json(data: dict, path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def _table(title: str, headers: list[str]) -> Table:
    table = Table(title=title)
    table.add_column("method", no_wrap=True)
    for header in headers:
        table.add_column(header, justify="right")
    return table


def _trace_cells(entry: dict) -> list[str]:
    cells = []
    for key, _, fmt in TRACE_COLUMNS:
        value = entry["median"][key]
        if key == "peak_kv_bytes":
            value /= 2**20
        ratio = entry.get("ratio", {}).get(key)
        cells.append(fmt.format(value) + (f" ({ratio:.2f}x)" if ratio is not None else ""))
    return cells


def trace_markdown(result: dict) -> str:
    """One row per method: medians over repeats, each with its ratio to NonShared in brackets."""
    header = ["method", *(h for _, h, _ in TRACE_COLUMNS)]
    lines = [
        f"Trace `{result['trace']}`: {result['turns']} turns, {result['trace_tokens']:,} tokens, "
        f"median of {result['repeats']} repeats; (x) = ratio to NonShared.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for name, entry in result["methods"].items():
        lines.append("| " + " | ".join([name, *_trace_cells(entry)]) + " |")
    lines += ["", result["latency_note"], ""]
    return "\n".join(lines)


def trace_table(result: dict) -> Table:
    """The same as :func:`trace_markdown`, for the terminal."""
    table = _table(
        f"trace {result['trace']}; (x) = ratio to NonShared (below 1x: less time or memory, above 1x: "
        f"more tokens/s)",
        [h for _, h, _ in TRACE_COLUMNS],
    )
    for name, entry in result["methods"].items():
        table.add_row(name, *_trace_cells(entry))
    return table


def _fidelity_columns(result: dict) -> list[tuple[str, str, str]]:
    """:data:`FIDELITY_COLUMNS` then the benchmark's metrics (``result["metrics"]``, default EM, F1)."""
    metrics = result.get("metrics", ("em", "f1"))
    return [*FIDELITY_COLUMNS, *((m, METRIC_HEADERS.get(m, m), "{:.3f}") for m in metrics)]


def _fidelity_cells(summary: dict, columns) -> list[str]:
    return ["-" if summary.get(k) is None else fmt.format(summary[k]) for k, _, fmt in columns]


def fidelity_markdown(result: dict) -> str:
    """One row per method: mean KL(NonShared || method), top-1 agreement, base-cache error, answers."""
    columns = _fidelity_columns(result)
    header = ["method", *(h for _, h, _ in columns)]
    lines = [
        f"Fidelity against NonShared ({result.get('benchmark', 'hotpotqa')}) over {result['episodes']} episodes, {result['turns']} agent turns.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for name, summary in result["methods"].items():
        lines.append("| " + " | ".join([name, *_fidelity_cells(summary, columns)]) + " |")
    return "\n".join(lines) + "\n"


def fidelity_table(result: dict) -> Table:
    columns = _fidelity_columns(result)
    table = _table(
        f"fidelity vs nonshared ({result.get('benchmark', 'hotpotqa')})", [h for _, h, _ in columns]
    )
    for name, summary in result["methods"].items():
        table.add_row(name, *_fidelity_cells(summary, columns))
    return table
