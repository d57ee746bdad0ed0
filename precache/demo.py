"""``precache demo``: one dev question answered by the plan / action / reflect adapters under
NonShared, PreLRShared and ReBaseShared, side by side (answer, EM, sum of TTFT, KV bytes, each with its ratio to NonShared)."""

from __future__ import annotations

import argparse
import logging

from rich.console import Console
from rich.table import Table

import precache
from precache import resources, terminal
from precache.agents.data import get_question, load_questions
from precache.agents.loop import run_episode
from precache.agents.prompt import ROLES

logger = logging.getLogger(__name__)

DEMO_METHODS = ("nonshared", "prelrshared", "rebaseshared-lp")


def run_demo(
    question_id: str | None = None,
    adapter_set: str = "qv",
    methods=DEMO_METHODS,
    console: Console | None = None,
) -> list[dict]:
    """Run one episode per method on the same dev question; return one result row per method.

    Row fields: ``method``, ``answer``, ``em``, ``f1``, ``ttft_sum_s``, ``latency_s`` (turn latencies,
    LP's neutral pass included), ``prefill_tokens``, ``kv_peak_bytes``, ``turns``.

    ``adapter_set``: ``qv`` / ``all`` (the committed sets) or a folder with ``<agent>/`` adapters.

    Raises:
        AdapterError: the adapter set, or an agent's adapter in it, is missing (run
            ``precache adapters train``).
    """
    adapters = resources.adapter_set(adapter_set, ROLES)
    console = console or terminal.console()
    # eager: a demo episode decodes a few hundred tokens, less than a cold compile of the decode
    # step costs (a minute or more per graph on 2 cores; docs/performance.md, "Compiled decode")
    model = precache.load_model(compile=False)
    question = get_question(question_id) if question_id else load_questions("dev")[0]
    console.print(
        f"[bold]Question[/] {question.id}: {question.question}\n[bold]Gold answer[/]: {question.answer}\n"
    )
    rows = []
    for method in methods:
        engine = precache.Engine(model, adapters=adapters, method=method)
        session = engine.session()
        turns = []
        with console.status(f"{method}: running the episode"):
            episode = run_episode(session, question, on_turn=turns.append)
        rows.append(
            {
                "method": method,
                "answer": episode.answer,
                "em": episode.em,
                "f1": episode.f1,
                "ttft_sum_s": sum(t.ttft_s for t in turns),
                "latency_s": episode.wall_s,
                "prefill_tokens": sum(t.prefill_tokens for t in turns),
                "kv_peak_bytes": session.cache_bytes()["peak"],
                "turns": len(turns),
            }
        )
        logger.info("%s: %d turns, answer %r", method, len(turns), episode.answer)
    console.print(_table(rows))
    return rows


def _table(rows: list[dict]) -> Table:
    """One row per method; times and memory with their ratio to the first row's (NonShared) in
    brackets, as ``bench trace`` prints them: below 1x is less time or memory."""
    base = rows[0]
    table = Table(
        title=f"One HotpotQA dev question; (x) = ratio to {base['method']} (below 1x: less time or memory)"
    )
    for col in ("method", "answer", "EM", "F1", "turns", "prefill tokens", "sum TTFT (s)", "KV peak (MiB)"):
        table.add_column(col, justify="left" if col in ("method", "answer") else "right")
    for r in rows:
        table.add_row(
            r["method"],
            r["answer"][:40],
            f"{r['em']:.0f}",
            f"{r['f1']:.2f}",
            str(r["turns"]),
            f"{r['prefill_tokens']:,} ({r['prefill_tokens'] / max(base['prefill_tokens'], 1):.2f}x)",
            f"{r['ttft_sum_s']:.2f} ({r['ttft_sum_s'] / max(base['ttft_sum_s'], 1e-9):.2f}x)",
            f"{r['kv_peak_bytes'] / 2**20:.1f} ({r['kv_peak_bytes'] / max(base['kv_peak_bytes'], 1):.2f}x)",
        )
    return table


def _demo(args: argparse.Namespace) -> int:
    run_demo(args.question, args.adapters)
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser(
        "demo", help="one dev question under NonShared, PreLRShared and ReBaseShared, side by side"
    )
    p.add_argument("--question", default=None, help="HotpotQA id (default: the first dev question)")
    p.add_argument("--adapters", default="qv", help="qv | all (committed sets) | DIR with DIR/<agent>/")
    p.set_defaults(func=_demo)
