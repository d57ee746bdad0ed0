"""``precache study``: the PReCache paper's comparison on our engine (issue 12, "The study").

Per benchmark x adapter set, on the questions of one split:

- the paper-style table (:func:`method_row`), at adapter scale 1: the benchmark's accuracy
  (HotpotQA: EM / F1; ScienceQA: option accuracy), its drop against NonShared (NonShared minus
  the method, so a positive drop is a loss), answer agreement with NonShared
  (:func:`precache.agents.evaluate.summarize`), ``turn_match`` (:func:`matching_turns`), the sum of
  TTFT (seconds) and of prefill tokens over every turn, and the teacher-forced KL / top-1 of
  :mod:`precache.bench.fidelity` on the recorded NonShared trajectories;
- the paper's Figure 2 diagnostic (:func:`~precache.bench.study_figure2.transition_errors`) on
  those recorded trajectories;
- the adapter-strength sweep: every adapter's B (and LoRA bias) scaled by each factor
  (:func:`scaled_adapter`), the same measures for NonShared, PreLRShared and ReBaseShared (LP).

Every phase runs ``concurrency`` episodes at once, their forwards batched in each engine
(:func:`~precache.engine.scheduler.run_concurrently`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

from precache.bench.common import methods_with_reference, positive_int
from precache.bench.study_figure2 import figure2

logger = logging.getLogger(__name__)

ROLES = ("plan", "action", "reflect")
SWEEP_METHODS = ("nonshared", "prelrshared", "rebaseshared-lp")


def scaled_adapter(adapter, factor: float):
    """A copy of ``adapter`` (:class:`~precache.lora.adapter.LoRAAdapter`) whose every B
    ``[rank, d_out]`` and LoRA bias are multiplied by ``factor``, i.e. ``Delta W -> factor Delta W``;
    ``adapter`` is left as it is. Factor 0 is the base model."""
    weights = {key: (a, b * factor) for key, (a, b) in adapter.weights.items()}
    biases = {key: b * factor for key, b in adapter.biases.items()}
    return dataclasses.replace(adapter, weights=weights, biases=biases)


def matching_turns(turns: list, reference: list) -> int:
    """How many turns of an episode equal the reference's (same agent, same appended ids, same
    generated ids), counted in order while every earlier turn matched: once the free-running
    trajectories part, no later turn is compared (its context differs)."""
    same = 0
    for turn, ref in zip(turns, reference, strict=False):
        if (turn.agent, tuple(turn.appended), list(turn.token_ids)) != (
            ref.agent,
            tuple(ref.appended),
            list(ref.token_ids),
        ):
            break
        same += 1
    return same


def method_row(episodes: list, reference: list, benchmark, questions: list, forced: dict) -> dict:
    """One line of the table: ``summarize``'s metrics and ``agreement``, ``turn_match`` (the share
    of the reference's turns matched by :func:`matching_turns`), ``sum_ttft_s``,
    ``prefill_tokens``, and ``first_kl`` / ``mean_kl`` / ``top1`` of ``forced``
    (:func:`~precache.bench.episodes.summarize_turns`). ``{metric}_drop`` is added by :func:`run_point`."""
    from precache.agents.evaluate import summarize

    summary = summarize(episodes, reference, benchmark, questions)
    turns = [t for e in episodes for t in e.turns]
    matched = sum(matching_turns(e.turns, r.turns) for e, r in zip(episodes, reference, strict=True))
    total = sum(len(r.turns) for r in reference)
    return {
        **{metric: summary[metric] for metric in benchmark.metrics},
        "agreement": float(summary["agreement"]),
        "turn_match": matched / total if total else None,
        "sum_ttft_s": sum(t.ttft_s for t in turns),
        "prefill_tokens": sum(t.prefill_tokens for t in turns),
        **{key: forced[key] for key in ("first_kl", "mean_kl", "top1")},
        "answers": [e.answer for e in episodes],
    }


def run_point(
    engines: dict, questions: list, benchmark, concurrency: int = 1, **episode_kwargs
) -> tuple[dict, list]:
    """Record NonShared episodes (``engines["nonshared"]``), run every other engine free on the
    same questions, teacher-force the recorded trajectories under every engine
    (:func:`~precache.bench.fidelity.compare_trajectory`). Returns ``({method: method_row},
    recorded turns per question)``; ``episode_kwargs`` go to :func:`~precache.agents.loop.run_episode`."""
    from precache.agents.loop import run_episode
    from precache.bench.episodes import RecordingSession, summarize_turns
    from precache.bench.fidelity import REFERENCE, compare_trajectory
    from precache.engine.scheduler import run_concurrently

    def record(question):
        rec = RecordingSession(engines[REFERENCE].session())
        episode = run_episode(rec, question, benchmark=benchmark, **episode_kwargs)
        episode.turns = rec.turns
        return episode

    reference = run_concurrently(record, questions, concurrency, desc=f"record {REFERENCE}")
    trajectories = [e.turns for e in reference]
    forced = run_concurrently(lambda t: compare_trajectory(engines, t, REFERENCE), trajectories, concurrency)
    rows = {}
    for name, engine in engines.items():
        episodes = reference
        if name != REFERENCE:
            episodes = run_concurrently(
                lambda q, engine=engine: run_episode(
                    engine.session(), q, benchmark=benchmark, **episode_kwargs
                ),
                questions,
                concurrency,
                desc=f"free {name}",
            )
        records = [r for by_method in forced for r in by_method[name]]
        rows[name] = method_row(episodes, reference, benchmark, questions, summarize_turns(records))
    for row in rows.values():
        for metric in benchmark.metrics:
            row[f"{metric}_drop"] = rows[REFERENCE][metric] - row[metric]
    return rows, trajectories


def _rebase_beats(point: dict, metric: str) -> dict:
    pre, rebase = point.get("prelrshared"), point.get("rebaseshared-lp")
    if pre is None or rebase is None:
        return {}
    return {
        "mean_kl": rebase["mean_kl"] < pre["mean_kl"],
        "agreement": rebase["agreement"] > pre["agreement"],
        metric: rebase[metric] > pre[metric],
    }


def run_study(
    model,
    adapters: dict,
    benchmark,
    questions: list,
    methods: list[str],
    scales: list[float],
    concurrency: int = 1,
    **episode_kwargs,
) -> dict:
    """The study of one benchmark x adapter set (``adapters``: loaded ``LoRAAdapter`` by role).

    The table and Figure 2 run at scale 1 with ``methods`` (NonShared first); each scale of
    ``scales`` runs :data:`SWEEP_METHODS` among ``methods`` on adapters scaled by it (scale 1 is
    run once). Returns ``{"questions", "table", "figure2", "sweep": {scale: {"methods":
    {method: row}, "rebase_beats": {measure: bool}}}}``.
    """
    import precache

    def engines_at(scale: float, names: list[str]) -> dict:
        scaled = {role: scaled_adapter(a, scale) for role, a in adapters.items()}
        return {m: precache.Engine(model, adapters=scaled, method=m, prefix_caching=False) for m in names}

    table, trajectories = run_point(
        engines_at(1.0, methods), questions, benchmark, concurrency, **episode_kwargs
    )
    sweep_methods = [m for m in methods if m in SWEEP_METHODS]
    sweep = {}
    for scale in scales:
        if scale == 1.0:
            point = {m: table[m] for m in sweep_methods}
        else:
            point, _ = run_point(
                engines_at(scale, sweep_methods), questions, benchmark, concurrency, **episode_kwargs
            )
        sweep[str(scale)] = {"methods": point, "rebase_beats": _rebase_beats(point, benchmark.metrics[0])}
    return {
        "questions": len(questions),
        "table": table,
        "figure2": figure2(model, adapters, trajectories),
        "sweep": sweep,
    }


def scale_list(text: str) -> list[float]:
    """An argparse ``type``: comma-separated adapter scales, each a finite number >= 0."""
    try:
        scales = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"scales must be numbers, got {text!r}") from None
    bad = [s for s in scales if not (s >= 0 and s != float("inf"))]
    if not scales or bad:
        raise argparse.ArgumentTypeError(f"scales must be finite numbers >= 0, got {text!r}")
    return scales


def plan_runs(benchmarks: str, adapter_sets: str) -> tuple[list[tuple], list[str]]:
    """``([(benchmark, set name, {role: folder})], skipped notes)`` before any model loads: a
    committed set not trained for a benchmark is skipped with a note (its
    :meth:`Benchmark.adapters` message); a folder must hold every role.

    Raises:
        UnknownBenchmarkError: a benchmark name is unknown.
        AdapterError: a folder lacks a role, or nothing is left to run.
    """
    from precache.agents.benchmark import get_benchmark
    from precache.errors import AdapterError
    from precache.resources import adapter_set

    runs, skipped = [], []
    for bench in [get_benchmark(b.strip()) for b in benchmarks.split(",") if b.strip()]:
        for name in [a.strip() for a in adapter_sets.split(",") if a.strip()]:
            try:
                folder = bench.adapters(name)
            except AdapterError as exc:
                skipped.append(f"skipped {bench.name} x {name}: {exc}")
                continue
            runs.append((bench, name, adapter_set(folder, ROLES)))
    if not runs:
        raise AdapterError("nothing to run: " + "; ".join(skipped))
    return runs, skipped


def _study(args: argparse.Namespace) -> int:
    import torch

    import precache
    from precache.bench import report, study_plots
    from precache.lora.adapter import load_adapter
    from precache.terminal import console

    if args.threads:
        torch.set_num_threads(args.threads)
    methods = methods_with_reference(args.methods)
    runs, skipped = plan_runs(args.benchmark, args.adapters)
    for note in skipped:
        logger.warning(note)
    model = precache.load_model(args.model)
    out = Path(args.out)
    results = {"skipped": skipped, "runs": {}}
    for bench, name, folders in runs:
        adapters = {role: load_adapter(folder, model.config, role) for role, folder in folders.items()}
        questions = bench.load_questions(args.split)[: args.limit]
        results["runs"][f"{bench.name}/{name}"] = {
            "benchmark": bench.name,
            "adapters": name,
            "metrics": list(bench.metrics),
            **run_study(
                model,
                adapters,
                bench,
                questions,
                methods,
                args.scales,
                args.concurrency,
                max_steps=args.max_steps,
                max_new_tokens=args.max_new_tokens,
            ),
        }
    results["config"] = {k: v for k, v in vars(args).items() if k != "func"}
    report.write_json(results, out / "study.json")
    markdown = study_plots.study_markdown(results)
    (out / "study.md").write_text(markdown, encoding="utf-8")
    study_plots.plot_study(results, out)
    console().print(markdown)
    return 0


def add_study(sub: argparse._SubParsersAction) -> None:
    """Register ``precache study`` on the ``precache`` parser."""
    from precache.methods import METHODS

    study = sub.add_parser(
        "study", help="the paper's comparison: table, Figure 2 errors, adapter-strength sweep"
    )
    study.add_argument("--benchmark", default="hotpotqa", help="comma-separated: hotpotqa,scienceqa")
    study.add_argument(
        "--adapters",
        default="qv",
        help="comma-separated committed sets (qv, all) or DIRs with DIR/<role>/; a committed set "
        "not trained for a benchmark is skipped with a note",
    )
    study.add_argument("--methods", default=",".join(METHODS), help="comma-separated sharing methods")
    study.add_argument("--split", choices=("dev", "train", "all"), default="dev")
    study.add_argument("--limit", type=positive_int, default=None, help="first N questions of the split")
    study.add_argument("--concurrency", type=positive_int, default=1, help="episodes run at once, batched")
    study.add_argument(
        "--scales", type=scale_list, default=[0.25, 0.5, 1.0, 2.0], help="adapter B scales of the sweep"
    )
    study.add_argument("--max-steps", type=int, default=8, help="plan steps per episode")
    study.add_argument("--max-new-tokens", type=int, default=64, help="tokens per agent turn")
    study.add_argument("--model", help="base checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    study.add_argument("--out", required=True, help="folder for study.json, study.md and the PNGs")
    study.add_argument(
        "--threads", type=int, default=int(os.environ.get("PRECACHE_THREADS", 0)), help="torch threads"
    )
    study.set_defaults(func=_study)
