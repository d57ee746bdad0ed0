"""``precache study``: the PReCache paper's comparison on our engine (issue 12, "The study").

Per benchmark x adapter set, on the questions of one split:

- the paper-style table (:func:`table`, :func:`method_row`), at adapter scale 1: the benchmark's accuracy
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
(:func:`~precache.engine.scheduler.run_concurrently`), and stores each group's per-question
results (:class:`PointStore`) before the next starts: the tables are aggregated from the stored
questions, so a stopped study resumes and a finished one only rebuilds its report.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import logging
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

from precache.bench.common import methods_with_reference, positive_int
from precache.errors import PrecacheError

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


def adapters_fingerprint(adapters: dict) -> str:
    """The first 16 hex digits of a sha256 over every role's LoRA weights as loaded (role names,
    scaling, each module's A, B and bias in fp32): a stored point run with other adapter weights
    (retrained, or stored in another dtype) does not match, whatever the folder is called."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for role in sorted(adapters):
        adapter = adapters[role]
        digest.update(f"{role}:{adapter.scaling!r}".encode())
        for key in sorted(adapter.weights):
            tensors = [*adapter.weights[key], *([adapter.biases[key]] if key in adapter.biases else [])]
            digest.update(repr(key).encode())
            for t in tensors:
                digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


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


def question_record(episode, reference, benchmark, question, forced: dict) -> dict:
    """What the table keeps of one method on one question (JSON-ready, stored by
    :class:`PointStore`): ``answer``, each of ``benchmark.metrics``, ``agrees`` (the answer's
    ``benchmark.answer_key`` equals the reference's), ``matched`` (:func:`matching_turns`) and
    ``reference_turns``, the sums of TTFT (seconds) and prefill tokens over its turns, and
    ``forced``: the teacher-forced per-turn records of :func:`~precache.bench.fidelity.compare_trajectory`."""
    return {
        "answer": episode.answer,
        **{metric: getattr(episode, metric) for metric in benchmark.metrics},
        "agrees": benchmark.answer_key(episode.answer, question)
        == benchmark.answer_key(reference.answer, question),
        "matched": matching_turns(episode.turns, reference.turns),
        "reference_turns": len(reference.turns),
        "turns": len(episode.turns),
        "stop_reason": episode.stop_reason,
        "ttft_s": sum(t.ttft_s for t in episode.turns),
        "prefill_tokens": sum(t.prefill_tokens for t in episode.turns),
        "forced": forced,
    }


def method_row(records: list[dict], benchmark) -> dict:
    """One line of the table from one method's :func:`question_record` s (questions in order):
    the mean of each metric, ``agreement`` (share of agreeing answers), ``turn_match`` (matched
    turns over the reference's turns), ``sum_ttft_s``, ``prefill_tokens``, ``first_kl`` /
    ``mean_kl`` / ``top1`` and the cache errors ``k_error`` (all earlier positions), ``k_error_own``
    / ``v_error_own`` (the reader's own earlier segments) and ``k_error_other`` / ``v_error_other``
    (the other agents') of the forced records (:func:`~precache.bench.episodes.summarize_turns`,
    :mod:`~precache.bench.fidelity`), ``answers``, and the same measures per agent
    (:func:`by_agent`). ``{metric}_drop`` is added by :func:`table`."""
    from precache.bench.episodes import summarize_turns

    n = len(records)
    total = sum(r["reference_turns"] for r in records)
    forced = summarize_turns([t for r in records for t in r["forced"]])
    return {
        **{metric: sum(r[metric] for r in records) / n if n else 0.0 for metric in benchmark.metrics},
        "agreement": sum(r["agrees"] for r in records) / n if n else 0.0,
        "turn_match": sum(r["matched"] for r in records) / total if total else None,
        "sum_ttft_s": sum(r["ttft_s"] for r in records),
        "prefill_tokens": sum(r["prefill_tokens"] for r in records),
        **{key: forced[key] for key in ("first_kl", "mean_kl", "top1")},
        **{
            key: forced[key]
            for key in ("k_error", "k_error_own", "k_error_other", "v_error_own", "v_error_other")
        },
        "answers": [r["answer"] for r in records],
        "by_agent": by_agent([t for r in records for t in r["forced"]]),
    }


def by_agent(forced: list[dict]) -> dict:
    """The teacher-forced measures per agent (the turn's reader): ``{agent: {"turns", "first_kl",
    "mean_kl", "top1", "k_error_own", "k_error_other"}}``
    (:func:`~precache.bench.episodes.summarize_turns` over that agent's turns). Where a method
    loses fidelity shows here: on the turns that re-read the agent's own earlier segments or on
    those that read the other agents'."""
    from precache.bench.episodes import summarize_turns

    agents = sorted({r["agent"] for r in forced}, key=str)
    keys = ("turns", "first_kl", "mean_kl", "top1", "k_error_own", "k_error_other")
    out = {}
    for agent in agents:
        summary = summarize_turns([r for r in forced if r["agent"] == agent])
        out[str(agent)] = {key: summary[key] for key in keys}
    return out


def parted_at(per_question: list[dict], method: str) -> dict:
    """Where ``method``'s free-running episodes part from NonShared's: per agent, on how many
    questions the first turn that differs (:func:`matching_turns`) is that agent's (``"none"``: no
    turn differs)."""
    from precache.bench.fidelity import REFERENCE

    counts: dict[str, int] = {}
    for q in per_question:
        record, reference = q["methods"][method], q["methods"][REFERENCE]["forced"]
        agent = (
            "none"
            if record["matched"] >= record["reference_turns"]
            else str(reference[record["matched"]]["agent"])
        )
        counts[agent] = counts.get(agent, 0) + 1
    return dict(sorted(counts.items()))


def table(per_question: list[dict], benchmark, methods: list[str]) -> dict:
    """``{method: method_row}`` over the stored questions, with ``{metric}_drop`` = the reference's
    (NonShared's) metric minus the method's (positive: a loss) and ``parted_at`` (:func:`parted_at`)."""
    from precache.bench.fidelity import REFERENCE

    rows = {m: method_row([q["methods"][m] for q in per_question], benchmark) for m in methods}
    for m, row in rows.items():
        row["parted_at"] = parted_at(per_question, m)
    for row in rows.values():
        for metric in benchmark.metrics:
            row[f"{metric}_drop"] = rows[REFERENCE][metric] - row[metric]
    return rows


def run_questions(
    engines: dict,
    questions: list,
    benchmark,
    concurrency: int = 1,
    model=None,
    adapters=None,
    **episode_kwargs,
) -> list[dict]:
    """Record NonShared episodes (``engines["nonshared"]``) on ``questions``, teacher-force the
    recorded trajectories under every engine (:func:`~precache.bench.fidelity.compare_trajectory`),
    run every other engine free on the same questions. Returns one dict per question: ``{"id",
    "methods": {method: question_record}}``, plus ``"figure2"`` (the
    :func:`~precache.bench.study_figure2.trajectory_transitions` of the recorded trajectory) when
    ``model`` and ``adapters`` are given. ``episode_kwargs`` go to
    :func:`~precache.agents.loop.run_episode`."""
    from precache.agents.loop import run_episode
    from precache.bench.episodes import RecordingSession
    from precache.bench.fidelity import REFERENCE, compare_trajectory
    from precache.bench.study_figure2 import trajectory_transitions
    from precache.engine.scheduler import run_concurrently

    def record(question):
        rec = RecordingSession(engines[REFERENCE].session())
        episode = run_episode(rec, question, benchmark=benchmark, **episode_kwargs)
        episode.turns = rec.turns
        return episode

    reference = run_concurrently(record, questions, concurrency, desc=f"record {REFERENCE}")
    forced = run_concurrently(
        lambda e: compare_trajectory(engines, e.turns, REFERENCE),
        reference,
        concurrency,
        desc="teacher-forced",
    )
    episodes = {REFERENCE: reference}
    for name, engine in engines.items():
        if name != REFERENCE:
            episodes[name] = run_concurrently(
                lambda q, engine=engine: run_episode(
                    engine.session(), q, benchmark=benchmark, **episode_kwargs
                ),
                questions,
                concurrency,
                desc=f"free {name}",
            )
    out = []
    for i, question in enumerate(questions):
        entry = {
            "id": question.id,
            "methods": {
                name: question_record(episodes[name][i], reference[i], benchmark, question, forced[i][name])
                for name in engines
            },
        }
        if model is not None:
            entry["figure2"] = trajectory_transitions(model, adapters, reference[i].turns)
        out.append(entry)
    return out


SIGNIFICANT = 6  # digits a stored float keeps


def _rounded(value):
    """``value`` (JSON-ready) with every float kept to :data:`SIGNIFICANT` significant digits."""
    if isinstance(value, float):
        return float(f"{value:.{SIGNIFICANT}g}")
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


class StoredResultsError(PrecacheError):
    """A study's ``--out`` folder holds questions run with other settings."""


class PointStore:
    """One point of the study (benchmark x adapter set x adapter scale) on disk, one gzipped JSON
    file per question under ``folder`` (``<question id>.json.gz``, floats kept to
    :data:`SIGNIFICANT` significant digits) plus ``point.json`` (the settings its questions were
    run with), so a study that stops resumes where it stopped and two processes can fill different
    points of one ``--out`` folder.

    Raises:
        StoredResultsError: ``folder`` holds questions run with other settings (it names both).
    """

    def __init__(self, folder: Path, settings: dict):
        import json

        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        meta = self.folder / "point.json"
        if meta.is_file():
            stored = json.loads(meta.read_text())
            if stored != settings:
                differ = ", ".join(
                    f"{key} {stored.get(key)!r} there, {settings.get(key)!r} now"
                    for key in sorted(set(stored) | set(settings), key=str)
                    if stored.get(key) != settings.get(key)
                )
                raise StoredResultsError(
                    f"{self.folder} holds questions run with other settings ({differ}): pass the settings "
                    "they were run with (--methods, --max-steps, --max-new-tokens, --model, the same adapter "
                    "weights), or use another --out"
                )
        else:
            meta.write_text(json.dumps(settings, indent=1) + "\n")

    def _path(self, question_id: str) -> Path:
        return self.folder / (re.sub(r"[^A-Za-z0-9_.-]", "_", str(question_id)) + ".json.gz")

    def missing(self, questions: list) -> list:
        """The questions with no stored result, in order."""
        return [q for q in questions if not self._path(q.id).is_file()]

    def stored(self, questions: list) -> list:
        """The questions with a stored result, in order."""
        return [q for q in questions if self._path(q.id).is_file()]

    def save(self, entry: dict) -> None:
        """Store one question's entry (written to a temporary file, then renamed)."""
        import json

        path = self._path(entry["id"])
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(gzip.compress(json.dumps(_rounded(entry), separators=(",", ":")).encode(), mtime=0))
        tmp.replace(path)

    def load(self, questions: list) -> list[dict]:
        """The stored entries of ``questions``, in order."""
        import json

        return [json.loads(gzip.decompress(self._path(q.id).read_bytes())) for q in questions]


def run_point(
    store: PointStore,
    make_engines: Callable[[], dict],
    questions: list,
    benchmark,
    concurrency: int = 1,
    model=None,
    adapters=None,
    shard: tuple[int, int] | None = None,
    **episode_kwargs,
) -> list[dict]:
    """:func:`run_questions` on the questions ``store`` lacks, ``concurrency`` at a time, each
    group stored as soon as it is done; returns every question's entry, in order. The engines are
    built (``make_engines()``) only when something is left to run.

    ``shard = (i, n)`` runs only the lacking questions at positions ``p`` of ``questions`` with
    ``p % n == i - 1`` (n processes fill one point between them) and returns ``[]``: the other
    shards' questions may not be stored yet."""
    missing = store.missing(questions)
    if shard is not None:
        i, n = shard
        position = {q.id: p for p, q in enumerate(questions)}
        missing = [q for q in missing if position[q.id] % n == i - 1]
    if missing:
        engines = make_engines()
        logger.info("%s: %d of %d questions to run", store.folder, len(missing), len(questions))
        for start in range(0, len(missing), concurrency):
            group = missing[start : start + concurrency]
            for entry in run_questions(
                engines, group, benchmark, concurrency, model=model, adapters=adapters, **episode_kwargs
            ):
                store.save(entry)
            logger.info(
                "%s: %d of %d questions done",
                store.folder,
                len(questions) - len(store.missing(questions)),
                len(questions),
            )
    return [] if shard is not None else store.load(questions)


def paired(entries: list[dict], method: str, other: str, benchmark) -> dict:
    """Question by question, ``method`` against ``other``: for ``agrees`` (the answer equals
    NonShared's) and each of ``benchmark.metrics``, how many questions ``method`` scores higher
    (``better``) and lower (``worse``), and the exact two-sided sign-test p-value of that split
    (McNemar's exact test for the 0/1 measures: under "neither is better" each discordant question
    goes either way with probability 1/2). Empty when either method did not run."""
    if not entries or any(m not in entries[0]["methods"] for m in (method, other)):
        return {}
    out = {}
    for measure in ("agrees", *benchmark.metrics):
        a = [float(q["methods"][method][measure]) for q in entries]
        b = [float(q["methods"][other][measure]) for q in entries]
        better = sum(x > y for x, y in zip(a, b, strict=True))
        worse = sum(x < y for x, y in zip(a, b, strict=True))
        out[measure] = {"better": better, "worse": worse, "p": sign_test(better, worse)}
    return out


def sign_test(better: int, worse: int) -> float:
    """Exact two-sided sign-test p-value of ``better`` against ``worse`` (ties dropped):
    ``min(1, 2 P[X <= min(better, worse)])`` for X ~ Binomial(better + worse, 1/2)."""
    n = better + worse
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(better, worse) + 1)) / 2**n
    return min(1.0, 2 * tail)


def _rebase_beats(point: dict, metric: str) -> dict:
    pre, rebase = point.get("prelrshared"), point.get("rebaseshared-lp")
    if pre is None or rebase is None:
        return {}
    if any(row[m] is None for row in (pre, rebase) for m in ("first_kl", "mean_kl", "agreement", metric)):
        return {}  # no question
    return {
        "first_kl": rebase["first_kl"] < pre["first_kl"],
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
    folder: str | os.PathLike,
    concurrency: int = 1,
    sweep_limit: int | None = None,
    report_only: bool = False,
    shard: tuple[int, int] | None = None,
    **episode_kwargs,
) -> dict | None:
    """The study of one benchmark x adapter set (``adapters``: loaded ``LoRAAdapter`` by role),
    stored question by question under ``folder`` (:class:`PointStore`; a study that stopped resumes).

    The table and Figure 2 run at scale 1 with ``methods`` (NonShared first) on ``questions``;
    each scale of ``scales`` runs :data:`SWEEP_METHODS` among ``methods`` on adapters scaled by it
    (:func:`scaled_adapter`; scale 1 is the table's run) on the first ``sweep_limit`` questions
    (default: all). Returns ``{"questions", "sweep_questions", "table", "paired", "figure2",
    "sweep": {scale: {"methods": {method: row}, "rebase_beats": {measure: bool}, "paired"}}}``
    (``paired``: ReBaseShared-LP against PreLRShared question by question, :func:`paired`).

    With ``shard = (i, n)`` only this process's share of every point runs (:func:`run_point`)
    and the result is ``{"shard": [i, n]}``: the report comes from ``report_only`` once every
    shard is stored. With ``report_only`` nothing runs: the table covers the questions of ``questions`` stored at
    scale 1, the sweep the first ``sweep_limit`` of them stored at every stored scale (a scale with
    nothing stored is left out); None when nothing is stored for this benchmark x adapter set.

    Raises:
        StoredResultsError: ``folder`` holds results run with other settings.
    """
    import precache
    from precache.bench.study_figure2 import summarize_transitions

    def engines_at(scale: float, names: list[str]) -> Callable[[], dict]:
        def make() -> dict:
            scaled = {role: scaled_adapter(a, scale) for role, a in adapters.items()}
            return {m: precache.Engine(model, adapters=scaled, method=m, prefix_caching=False) for m in names}

        return make

    settings = {
        "benchmark": benchmark.name,
        # the checkpoint folder's name (the embedded model's is its content hash), not where it lies
        "model": Path(str(model.path)).name if getattr(model, "path", None) else None,
        "adapters": adapters_fingerprint(adapters),
        **episode_kwargs,
    }
    folder = Path(folder)
    sweep_methods = [m for m in methods if m in SWEEP_METHODS]

    def store_at(scale: float, names: list[str]) -> PointStore | None:
        path = folder / f"scale-{scale}"
        if report_only and not (path / "point.json").is_file():
            return None
        return PointStore(path, {**settings, "scale": scale, "methods": names})

    main_store = store_at(1.0, methods)
    if main_store is None:
        return None
    if report_only:
        questions = main_store.stored(questions)
        if not questions:  # a study stopped during its first group leaves point.json alone
            return None
    main = run_point(
        main_store,
        engines_at(1.0, methods),
        questions,
        benchmark,
        concurrency,
        model=model,
        adapters=adapters,
        shard=shard,
        **episode_kwargs,
    )
    if shard is not None:  # this process's share of the sweep; the report waits for --report-only
        for scale in scales:
            if scale != 1.0:
                run_point(
                    store_at(scale, sweep_methods),
                    engines_at(scale, sweep_methods),
                    questions[:sweep_limit],
                    benchmark,
                    concurrency,
                    shard=shard,
                    **episode_kwargs,
                )
        return {"shard": list(shard)}
    sweep_questions = questions[:sweep_limit]
    stores = {scale: store_at(scale, sweep_methods) for scale in scales if scale != 1.0}
    stores = {scale: store for scale, store in stores.items() if store is not None}
    if report_only:  # scales with something stored; the questions all of them have, so the points compare
        stores = {scale: store for scale, store in stores.items() if store.stored(sweep_questions)}
        for store in stores.values():
            sweep_questions = store.stored(sweep_questions)
    sweep = {}
    for scale in scales:
        if scale == 1.0:
            by_id = {q["id"]: q for q in main}
            entries = [by_id[q.id] for q in sweep_questions]
        elif scale in stores:
            entries = run_point(
                stores[scale],
                engines_at(scale, sweep_methods),
                sweep_questions,
                benchmark,
                concurrency,
                **episode_kwargs,
            )
        else:
            continue
        point = table(entries, benchmark, sweep_methods)
        sweep[str(scale)] = {
            "methods": point,
            "rebase_beats": _rebase_beats(point, benchmark.metrics[0]),
            "paired": paired(entries, "rebaseshared-lp", "prelrshared", benchmark),
        }
    return {
        "questions": len(questions),
        "sweep_questions": len(sweep_questions),
        "table": table(main, benchmark, methods),
        "paired": paired(main, "rebaseshared-lp", "prelrshared", benchmark),
        "figure2": summarize_transitions([t for q in main for t in q["figure2"]]),
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


def shard_spec(text: str) -> tuple[int, int]:
    """An argparse ``type``: ``I/N`` with 1 <= I <= N, as ``(I, N)``."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes I/N (e.g. 1/2), got {text!r}") from None
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"--shard I/N needs 1 <= I <= N, got {text!r}")
    return i, n


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


#: the run settings ``--report-only`` takes from a stored point when not given, with their defaults
RUN_SETTINGS = {"methods": None, "max_steps": 8, "max_new_tokens": 64}


def run_settings(args: argparse.Namespace, folder: Path) -> dict:
    """``methods`` / ``max_steps`` / ``max_new_tokens`` of one benchmark x adapter set: as given on
    the command line; those not given are, with ``--report-only``, the ones stored in
    ``folder/scale-1.0/point.json`` (so the report needs no flags repeated), else the defaults
    (every method, 8 steps, 64 tokens). ``methods`` always has NonShared first.

    Raises:
        UnknownMethodError: a given method is unknown.
    """
    import json

    from precache.methods import METHODS

    stored = {}
    meta = folder / "scale-1.0" / "point.json"
    if args.report_only and meta.is_file():
        stored = json.loads(meta.read_text())
    chosen = {}
    for key, default in RUN_SETTINGS.items():
        value = getattr(args, key)
        if value is None:
            value = stored.get(key, default)
        chosen[key] = value
    methods = chosen["methods"] or list(METHODS)
    chosen["methods"] = methods_with_reference(methods if isinstance(methods, str) else ",".join(methods))
    return chosen


def _study(args: argparse.Namespace) -> int:
    import torch

    import precache
    from precache.bench import report, study_plots
    from precache.lora.adapter import load_adapter
    from precache.terminal import console

    if args.report_only and args.concurrency != 1:
        raise StoredResultsError("--report-only runs nothing: --concurrency would have no effect")
    if args.report_only and args.shard is not None:
        raise StoredResultsError("--report-only runs nothing: --shard would have no effect")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.methods is not None:
        methods_with_reference(args.methods)  # an unknown method is refused before the model loads
    runs, skipped = plan_runs(args.benchmark, args.adapters)
    for note in skipped:
        logger.warning(note)
    model = precache.load_model(args.model)
    out = Path(args.out)
    results = {"skipped": skipped, "runs": {}}
    for bench, name, folders in runs:
        adapters = {role: load_adapter(folder, model.config, role) for role, folder in folders.items()}
        questions = bench.load_questions(args.split)[: args.limit]
        folder = out / "questions" / re.sub(r"[^A-Za-z0-9_.-]", "_", f"{bench.name}-{name}")
        settings = run_settings(args, folder)
        study = run_study(
            model,
            adapters,
            bench,
            questions,
            settings["methods"],
            args.scales,
            folder,
            args.concurrency,
            args.sweep_limit,
            args.report_only,
            shard=args.shard,
            max_steps=settings["max_steps"],
            max_new_tokens=settings["max_new_tokens"],
        )
        if args.shard is not None:
            continue
        if study is None:
            results["skipped"].append(f"skipped {bench.name} x {name}: nothing stored under {folder}")
            logger.warning(results["skipped"][-1])
            continue
        key = f"{bench.name}/{name}"
        results["runs"][key] = {
            "benchmark": bench.name,
            "adapters": name,
            "metrics": list(bench.metrics),
            "settings": {**settings, "methods": ",".join(settings["methods"])},
            **study,
        }
    if args.shard is not None:
        i, n = args.shard
        logger.info(
            "shard %d/%d stored under %s; once all %d shards are done, `--report-only` writes the report",
            i,
            n,
            out / "questions",
            n,
        )
        return 0
    if not results["runs"]:
        raise StoredResultsError(f"nothing stored under {out / 'questions'} to report on")
    results["config"] = {k: v for k, v in vars(args).items() if k != "func"}
    if args.report_only:  # what the report covers, not the defaults of flags that ran nothing
        results["config"]["scales"] = sorted(
            {float(x) for run in results["runs"].values() for x in run["sweep"]}
        )
        del results["config"]["concurrency"]
    for key in RUN_SETTINGS:  # the settings the runs used, where the command left them to the store
        if results["config"][key] is None:
            used = {run["settings"][key] for run in results["runs"].values()}
            results["config"][key] = used.pop() if len(used) == 1 else "per run"
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
    study.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated sharing methods (default: all, {','.join(METHODS)}; with --report-only: "
        "the stored ones)",
    )
    study.add_argument("--split", choices=("dev", "train", "all"), default="dev")
    study.add_argument("--limit", type=positive_int, default=None, help="first N questions of the split")
    study.add_argument("--concurrency", type=positive_int, default=1, help="episodes run at once, batched")
    study.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rebuild study.json, study.md and the PNGs from the questions stored under --out",
    )
    study.add_argument(
        "--shard",
        type=shard_spec,
        default=None,
        help="I/N: run only every N-th question from the I-th (N processes fill one --out between "
        "them; then --report-only writes the report)",
    )
    study.add_argument(
        "--sweep-limit",
        type=positive_int,
        default=None,
        help="first N questions of the sweep (default: --limit)",
    )
    study.add_argument(
        "--scales", type=scale_list, default=[0.25, 0.5, 1.0, 2.0], help="adapter B scales of the sweep"
    )
    study.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="plan steps per episode (default 8; --report-only: stored)",
    )
    study.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens per agent turn (default 64; --report-only: stored)",
    )
    study.add_argument("--model", help="base checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    study.add_argument(
        "--out",
        required=True,
        help="folder for study.json, study.md, the PNGs and questions/ (each question's results as it "
        "finishes: a study run again with the same --out resumes)",
    )
    study.add_argument(
        "--threads", type=int, default=int(os.environ.get("PRECACHE_THREADS", 0)), help="torch threads"
    )
    study.set_defaults(func=_study)
