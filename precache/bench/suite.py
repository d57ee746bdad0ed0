"""The trace benchmark: every method (and the HF + PEFT baseline) on one trace, in one process.

All replays use the same appended token stream. A short warm-up replay per runner comes first
(the first turns, each at most 32 prompt and 2 decode tokens: every code path once, so the first
timed replay pays no first-call cost);
then ``repeats`` rounds, each running every runner once (interleaved, so a slow spell on the
machine hits all methods alike). Per runner the result is the median of each metric over the
rounds, and its ratio to NonShared's median.
"""

from __future__ import annotations

import itertools
import logging
import os
import platform
import statistics
from collections.abc import Callable

import torch
from rich.console import Console
from rich.progress import Progress

from precache.bench.replay import Replay
from precache.bench.trace import Trace

logger = logging.getLogger(__name__)

REFERENCE = "nonshared"
WARMUP_TURNS, WARMUP_LEN, WARMUP_DECODE = 3, 32, 2
LATENCY_NOTE = (
    "latency_s = sum over turns of (TTFT + decode) + ReBaseShared LP's post-turn neutral pass "
    "(on the single stream between turns, not on any TTFT); DB's neutral row runs inside each "
    "forward and is already in TTFT / decode. throughput_tok_s = trajectory tokens / latency_s."
)

Runner = Callable[[Trace, list[list[int]]], Replay]


def machine_info() -> dict:
    """CPU, core count, torch version and intra-op threads, for the report."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _median_turns(replays: list[Replay]) -> dict[str, list[float]]:
    n = len(replays[0].turns)
    return {
        "ttft_s": [statistics.median(r.turns[i].ttft_s for r in replays) for i in range(n)],
        "kv_bytes": [float(replays[0].turns[i].kv_bytes) for i in range(n)],
    }


def summarize(replays: dict[str, list[Replay]], trace: Trace, reference: str = REFERENCE) -> dict:
    """Medians over repeats per runner, ratios to ``reference``, per-turn TTFT and KV bytes.

    Returns ``{"trace", "trace_tokens", "turns", "trajectory_after_turn", "repeats", "latency_note",
    "machine", "methods": {name: {"median", "ratio", "runs", "turns"}}}``; a ratio is the runner's median over the reference's (1.0 for the
    reference; absent when the reference did not run).
    """
    methods = {}
    for name, runs in replays.items():
        per_run = [r.metrics() for r in runs]
        median = {k: statistics.median(m[k] for m in per_run) for k in per_run[0]}
        methods[name] = {"median": median, "runs": per_run, "turns": _median_turns(runs)}
        methods[name]["turns"]["agent"] = [t.agent for t in runs[0].turns]
    if reference in methods:
        ref = methods[reference]["median"]
        for entry in methods.values():
            entry["ratio"] = {k: (v / ref[k] if ref[k] else None) for k, v in entry["median"].items()}
    return {
        "trace": trace.name,
        "trace_tokens": trace.total_tokens,
        "turns": len(trace.turns),
        "trajectory_after_turn": list(
            itertools.accumulate(t.prefill_len + t.decode_len for t in trace.turns)
        ),
        "repeats": len(next(iter(replays.values()))),
        "latency_note": LATENCY_NOTE,
        "machine": machine_info(),
        "methods": methods,
    }


def run_suite(runners: dict[str, Runner], trace: Trace, stream: list[list[int]], repeats: int = 3) -> dict:
    """Warm up, then replay ``trace`` ``repeats`` times with every runner; return :func:`summarize`.

    ``runners`` maps a name (a method, or ``hf-peft``) to ``runner(trace, stream) -> Replay``.

    Raises:
        ValueError: ``repeats < 1`` or no runner.
    """
    if repeats < 1 or not runners:
        raise ValueError(f"need repeats >= 1 and at least one runner (got {repeats}, {list(runners)})")
    warm = trace.head(WARMUP_TURNS, WARMUP_LEN, WARMUP_DECODE)
    warm_stream = [ids[:WARMUP_LEN] for ids in stream[:WARMUP_TURNS]]
    replays: dict[str, list[Replay]] = {name: [] for name in runners}
    err = Console(stderr=True)  # the bar on a terminal only, never in piped results
    with Progress(transient=True, console=err, disable=not err.is_terminal) as progress:
        task = progress.add_task(f"replay {trace.name}", total=len(runners) * (repeats + 1))
        for name, runner in runners.items():
            progress.update(task, description=f"warm-up {name}")
            runner(warm, warm_stream)
            progress.advance(task)
        for round_ in range(repeats):
            for name, runner in runners.items():
                progress.update(task, description=f"round {round_ + 1}/{repeats} {name}")
                replays[name].append(runner(trace, stream))
                logger.debug("%s round %d: %s", name, round_, replays[name][-1].metrics())
                progress.advance(task)
    return summarize(replays, trace)
