"""Running ``precache study`` (:mod:`precache.bench.study`) for one benchmark x adapter set.

Every phase runs ``concurrency`` episodes at once, their forwards batched in each engine
(:func:`~precache.engine.concurrency.run_concurrently`), and stores each group's per-question
results (:class:`~precache.bench.study.store.PointStore`) before the next starts: the tables are
aggregated from the stored questions (:mod:`precache.bench.study.stats`), so a stopped study
resumes and a finished one only rebuilds its report.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path

import precache
from precache.agents.loop import run_episode
from precache.bench.episodes import RecordingSession
from precache.bench.fidelity import REFERENCE, compare_trajectory
from precache.bench.study.figure2 import summarize_transitions, trajectory_transitions
from precache.bench.study.stats import paired, question_record, rebase_beats, table
from precache.bench.study.store import PointStore, adapters_fingerprint, revision
from precache.bench.study.uncertainty import uncertainty
from precache.engine.concurrency import run_concurrently

logger = logging.getLogger(__name__)

SWEEP_METHODS = ("nonshared", "prelrshared", "rebaseshared-lp")


def scaled_adapter(adapter, factor: float):
    """A copy of ``adapter`` (:class:`~precache.lora.adapter.LoRAAdapter`) whose every B
    ``[rank, d_out]`` and LoRA bias are multiplied by ``factor``, i.e. ``Delta W -> factor Delta W``;
    ``adapter`` is left as it is. Factor 0 is the base model."""
    weights = {key: (a, b * factor) for key, (a, b) in adapter.weights.items()}
    biases = {key: b * factor for key, b in adapter.biases.items()}
    return dataclasses.replace(adapter, weights=weights, biases=biases)


def run_questions(
    engines: dict,
    questions: list,
    benchmark,
    concurrency: int = 1,
    model=None,
    adapters=None,
    free: list[str] | None = None,
    **episode_kwargs,
) -> list[dict]:
    """Record NonShared episodes (``engines["nonshared"]``) on ``questions``, teacher-force the
    recorded trajectories under every engine (:func:`~precache.bench.fidelity.compare_trajectory`),
    run the engines named in ``free`` (default: every one) free on the same questions (the cache
    errors of the forced replay are measured for those only). Returns one
    dict per question: ``{"id", "methods": {method: question_record}}`` (each free-run row with the
    method's ``revision``; an engine not run free gets only ``{"forced": ...}``), plus
    ``"figure2"`` (the :func:`~precache.bench.study.figure2.trajectory_transitions` of the recorded
    trajectory) when ``model`` and ``adapters`` are given. ``episode_kwargs`` go to
    :func:`~precache.agents.loop.run_episode`."""
    free = list(engines) if free is None else [REFERENCE, *(m for m in free if m != REFERENCE)]

    def record(question):
        rec = RecordingSession(engines[REFERENCE].session())
        episode = run_episode(rec, question, benchmark=benchmark, **episode_kwargs)
        episode.turns = rec.turns
        return episode

    def run_free(question, engine):
        return run_episode(engine.session(), question, benchmark=benchmark, **episode_kwargs)

    reference = run_concurrently(record, questions, concurrency, desc=f"record {REFERENCE}")
    forced = run_concurrently(
        lambda e: compare_trajectory(engines, e.turns, REFERENCE, errors=set(free)),
        reference,
        concurrency,
        desc="teacher-forced",
    )
    episodes = {REFERENCE: reference}
    for name in free:
        if name != REFERENCE:
            engine = engines[name]
            episodes[name] = run_concurrently(
                lambda q, engine=engine: run_free(q, engine), questions, concurrency, desc=f"free {name}"
            )
    out = []
    for i, question in enumerate(questions):
        methods = {}
        for name in engines:
            if name in episodes:
                row = question_record(episodes[name][i], reference[i], benchmark, question, forced[i][name])
                methods[name] = {**row, "revision": revision(name)}
            else:
                methods[name] = {"forced": forced[i][name]}
        entry = {"id": question.id, "methods": methods}
        if model is not None:
            entry["figure2"] = trajectory_transitions(model, adapters, reference[i].turns)
        out.append(entry)
    return out


def merged(entry: dict, stored: dict | None) -> dict:
    """``entry`` (:func:`run_questions`) over the question's ``stored`` one: a method not run free
    keeps its stored row, each teacher-forced turn with the ``kv_bytes`` of the new replay (the
    same trajectory); the stored Figure 2 is kept when the entry has none."""
    if stored is None:
        return entry
    methods = dict(stored["methods"])
    for name, row in entry["methods"].items():
        if set(row) == {"forced"} and name in methods:
            old = methods[name]["forced"]
            forced = [{**t, "kv_bytes": n["kv_bytes"]} for t, n in zip(old, row["forced"], strict=True)]
            methods[name] = {**methods[name], "forced": forced}
        else:
            methods[name] = row
    out = {**stored, **entry, "methods": methods}
    if "figure2" not in entry and "figure2" in stored:
        out["figure2"] = stored["figure2"]
    return out


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
    """:func:`run_questions` on the questions whose methods ``store`` lacks (or holds at an older
    revision: :meth:`PointStore.lacking`), ``concurrency`` at a time, each group merged with what
    was stored (:func:`merged`: only the lacking methods run free; every method is teacher-forced
    again) and stored as soon as it is done; returns every question's entry, in order. The engines
    are built (``make_engines()``) only when something is left to run; Figure 2 (``model``) runs
    only for questions with nothing stored.

    ``shard = (i, n)`` runs only the lacking questions at positions ``p`` of ``questions`` with
    ``p % n == i - 1`` (n processes fill one point between them) and returns ``[]``: the other
    shards' questions may not be stored yet."""
    lacking = store.lacking(questions)
    if shard is not None:
        i, n = shard
        position = {q.id: p for p, q in enumerate(questions)}
        lacking = [(q, need) for q, need in lacking if position[q.id] % n == i - 1]
    if lacking:
        engines = make_engines()
        logger.info("%s: %d of %d questions to run", store.folder, len(lacking), len(questions))
        for start in range(0, len(lacking), concurrency):
            group = lacking[start : start + concurrency]
            stored = [store.entry(q) for q, _ in group]
            free = [m for m in engines if any(m in need for _, need in group)]
            with_figure2 = model is not None and all(e is None for e in stored)
            entries = run_questions(
                engines,
                [q for q, _ in group],
                benchmark,
                concurrency,
                model=model if with_figure2 else None,
                adapters=adapters,
                free=free,
                **episode_kwargs,
            )
            for entry, old in zip(entries, stored, strict=True):
                store.save(merged(entry, old))
            logger.info("%s: %d of %d questions done", store.folder, start + len(group), len(lacking))
    return [] if shard is not None else store.load(questions)


@dataclasses.dataclass
class _Points:
    """The points of one benchmark x adapter set: a :class:`PointStore` per adapter scale under
    ``folder/scale-<scale>``, and engines over the adapters scaled by it."""

    model: object
    adapters: dict
    benchmark: object
    folder: Path
    concurrency: int
    report_only: bool
    episode_kwargs: dict
    settings: dict = dataclasses.field(init=False)  # what every point.json of the set records

    def __post_init__(self):
        self.settings = {
            "benchmark": self.benchmark.name,
            # the checkpoint folder's name (the embedded model's is its content hash), not where it lies
            "model": Path(str(self.model.path)).name if getattr(self.model, "path", None) else None,
            "adapters": adapters_fingerprint(self.adapters),
            **self.episode_kwargs,
        }

    def store(self, scale: float, methods: list[str]) -> PointStore | None:
        """The point's store; None with ``report_only`` when nothing was ever stored there."""
        path = self.folder / f"scale-{scale}"
        if self.report_only and not (path / "point.json").is_file():
            return None
        return PointStore(path, {**self.settings, "scale": scale, "methods": methods})

    def run(self, store, scale, methods, questions, shard=None, figure2=False) -> list[dict]:
        """:func:`run_point` of ``methods`` at ``scale`` (``figure2``: with the Figure 2 errors)."""

        def make() -> dict:
            scaled = {role: scaled_adapter(a, scale) for role, a in self.adapters.items()}
            return {
                m: precache.Engine(self.model, adapters=scaled, method=m, prefix_caching=False)
                for m in methods
            }

        return run_point(
            store,
            make,
            questions,
            self.benchmark,
            self.concurrency,
            model=self.model if figure2 else None,
            adapters=self.adapters if figure2 else None,
            shard=shard,
            **self.episode_kwargs,
        )


def _sweep(points: _Points, main: list[dict], scales: list[float], methods: list[str], questions: list):
    """``(sweep, questions)``: the sweep table per scale (scale 1 from ``main``, the table's run)
    and the questions it covers (with ``report_only``: those every stored scale has)."""
    stores = {scale: points.store(scale, methods) for scale in scales if scale != 1.0}
    stores = {scale: store for scale, store in stores.items() if store is not None}
    if (
        points.report_only
    ):  # scales with something stored; the questions all of them have, so the points compare
        stores = {scale: store for scale, store in stores.items() if store.stored(questions)}
        for store in stores.values():
            questions = store.stored(questions)
    sweep, benchmark = {}, points.benchmark
    for scale in scales:
        if scale == 1.0:
            by_id = {q["id"]: q for q in main}
            entries = [by_id[q.id] for q in questions]
        elif scale in stores:
            entries = points.run(stores[scale], scale, methods, questions)
        else:
            continue
        point = table(entries, benchmark, methods)
        sweep[str(scale)] = {
            "methods": point,
            "rebase_beats": rebase_beats(point, benchmark.metrics[0]),
            "paired": paired(entries, "rebaseshared-lp", "prelrshared", benchmark),
        }
    return sweep, questions


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
    (default: all). Returns ``{"questions", "sweep_questions", "table", "uncertainty"
    (:func:`~precache.bench.study.uncertainty.uncertainty`), "paired", "figure2",
    "sweep": {scale: {"methods": {method: row}, "rebase_beats": {measure: bool}, "paired"}}}``
    (``paired``: ReBaseShared-LP against PreLRShared question by question,
    :func:`~precache.bench.study.stats.paired`; ``paired_own``: ReBaseOwnShared-LP against each of
    PreLRShared and ReBaseShared-LP, empty where a method did not run).

    With ``shard = (i, n)`` only this process's share of every point runs (:func:`run_point`)
    and the result is ``{"shard": [i, n]}``: the report comes from ``report_only`` once every
    shard is stored. With ``report_only`` nothing runs: the table covers the questions of ``questions`` stored at
    scale 1 with every method at its current revision, the sweep the first ``sweep_limit`` of them stored at every stored scale (a scale with
    nothing stored is left out); None when nothing is stored for this benchmark x adapter set.

    Raises:
        StoredResultsError: ``folder`` holds results run with other settings.
    """
    points = _Points(model, adapters, benchmark, Path(folder), concurrency, report_only, episode_kwargs)
    sweep_methods = [m for m in methods if m in SWEEP_METHODS]
    main_store = points.store(1.0, methods)
    if main_store is None:
        return None
    if report_only:
        lacking = {q.id for q, _ in main_store.lacking(questions)}
        questions = [q for q in main_store.stored(questions) if q.id not in lacking]  # every method current
        if not questions:  # a study stopped during its first group leaves point.json alone
            return None
    main = points.run(main_store, 1.0, methods, questions, shard=shard, figure2=True)
    if shard is not None:  # this process's share of the sweep; the report waits for --report-only
        for scale in scales:
            if scale != 1.0:
                points.run(
                    points.store(scale, sweep_methods), scale, sweep_methods, questions[:sweep_limit], shard
                )
        return {"shard": list(shard)}
    sweep, sweep_questions = _sweep(points, main, scales, sweep_methods, questions[:sweep_limit])
    return {
        "questions": len(questions),
        "sweep_questions": len(sweep_questions),
        "table": table(main, benchmark, methods),
        "uncertainty": uncertainty(main, methods, benchmark.metrics),
        "paired": paired(main, "rebaseshared-lp", "prelrshared", benchmark),
        "paired_own": {
            other: paired(main, "rebaseownshared-lp", other, benchmark)
            for other in ("prelrshared", "rebaseshared-lp")
        },
        "figure2": summarize_transitions([t for q in main for t in q["figure2"]]),
        "sweep": sweep,
    }
