"""The benchmarks the agents run: what differs between HotpotQA and ScienceQA, in one record.

The loop (:func:`~precache.agents.loop.run_episode`), evaluation, gold trajectories and adapter
training take a :class:`Benchmark`; the trajectory protocol (:mod:`precache.agents.prompt`) is
shared. ``get_benchmark("hotpotqa")`` is the default everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from precache.agents import data, gold, prompt, scienceqa, scienceqa_tools
from precache.agents.scoring import exact_match, f1, normalize_answer
from precache.agents.tools import StepResult, ToolEnv
from precache.errors import AdapterError, PrecacheError
from precache.registry import Registry
from precache.resources import ADAPTER_ROOT, ADAPTER_SETS


class UnknownBenchmarkError(PrecacheError):
    """A benchmark name that is not one of ``BENCHMARKS``."""


class Environment(Protocol):
    """The tools of one question: ``step("Type[argument]")`` never raises on bad input."""

    def step(self, action: str) -> StepResult: ...


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: its questions, tools, first piece, scoring, gold trajectories and adapters.

    ``score(answer, question)`` returns the episode's metrics by name (``metrics``, values in
    [0, 1]); ``answer_key(answer, question)`` is what two answers must share to agree (HotpotQA:
    the normalised answer; ScienceQA: the option letter); ``adapter_root / <set>`` holds the
    committed adapters trained on it.
    """

    name: str
    load_questions: Callable[[str], list]
    get_question: Callable[[str], Any]
    header: Callable[[Any], str]
    environment: Callable[[Any], Environment]
    score: Callable[[str, Any], dict[str, float]]
    answer_key: Callable[[str, Any], str]
    gold_trajectories: Callable[..., list[list[prompt.Piece]]]
    metrics: tuple[str, ...]
    adapter_root: Path

    def adapters(self, name_or_dir: str) -> str:
        """A committed set name (``qv``, ``all``) as this benchmark's folder; a folder as given.

        Raises:
            AdapterError: the named set was not trained for this benchmark (the message says how).
        """
        if name_or_dir not in ADAPTER_SETS:
            return name_or_dir
        folder = self.adapter_root / name_or_dir
        if not folder.is_dir():
            raise AdapterError(
                f"no {name_or_dir} adapter set for {self.name} under {folder} (train it with "
                f"`precache adapters train --benchmark {self.name} --set {name_or_dir}`, or pass --adapters DIR)"
            )
        return str(folder)


def _scienceqa_key(answer: str, question: scienceqa.ScienceQuestion) -> str:
    return scienceqa.parse_option(answer, question) or normalize_answer(answer)


def _hotpotqa_score(answer: str, question: data.Question) -> dict[str, float]:
    if not question.answer:
        return {"em": 0.0, "f1": 0.0}
    return {"em": exact_match(answer, question.answer), "f1": f1(answer, question.answer)}


def _scienceqa_score(answer: str, question: scienceqa.ScienceQuestion) -> dict[str, float]:
    return {"accuracy": scienceqa.option_accuracy(answer, question)}


HOTPOTQA = Benchmark(
    name="hotpotqa",
    load_questions=data.load_questions,
    get_question=data.get_question,
    header=lambda question: prompt.header(question.question),
    environment=ToolEnv,
    score=_hotpotqa_score,
    answer_key=lambda answer, question: normalize_answer(answer),
    gold_trajectories=gold.gold_trajectories,
    metrics=("em", "f1"),
    adapter_root=ADAPTER_ROOT,
)
SCIENCEQA = Benchmark(
    name="scienceqa",
    load_questions=scienceqa.load_questions,
    get_question=scienceqa.get_question,
    header=scienceqa_tools.header,
    environment=scienceqa_tools.ScienceQAEnv,
    score=_scienceqa_score,
    answer_key=_scienceqa_key,
    gold_trajectories=functools.partial(gold.gold_trajectories, trajectory=scienceqa_tools.gold_trajectory),
    metrics=("accuracy",),
    adapter_root=ADAPTER_ROOT.parent / f"{ADAPTER_ROOT.name}-scienceqa",
)
#: the benchmarks by name (``--benchmark``)
BENCHMARKS: Registry[Benchmark] = Registry("benchmark", UnknownBenchmarkError)
BENCHMARKS.register(HOTPOTQA.name, HOTPOTQA)
BENCHMARKS.register(SCIENCEQA.name, SCIENCEQA)


def get_benchmark(name: str) -> Benchmark:
    """The benchmark called ``name`` (any case).

    Raises:
        UnknownBenchmarkError: no benchmark has that name; the message lists them.
    """
    return BENCHMARKS[name]
