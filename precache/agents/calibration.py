"""DroidSpeak's calibration text per benchmark and ``precache adapters profile-droidspeak``.

The sharing method (:mod:`precache.methods.droidspeak`) profiles on whatever token ids it is given;
this module makes them from a benchmark's first train questions, so that a committed adapter set
is profiled on the text it was trained for, and writes the profile next to the adapters.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import precache.models
from precache.agents.benchmark import BENCHMARKS, get_benchmark
from precache.agents.data import Question
from precache.agents.scienceqa import ScienceQuestion
from precache.agents.scienceqa_tools import image_observation
from precache.lora.adapter import load_adapter
from precache.methods.droidspeak import save_profile
from precache.resources import adapter_set

logger = logging.getLogger(__name__)


def calibration_text(question: Question | ScienceQuestion, benchmark: str) -> str:
    """The calibration text of one question of ``benchmark``: HotpotQA, the question then one line
    ``title: sentences`` per paragraph; ScienceQA, the question with its ``Options:`` line, then the
    image's caption and OCR text as the ``Image`` tool shows them (questions with an image only).

    Raises:
        UnknownBenchmarkError: ``benchmark`` is neither.
    """
    name = BENCHMARKS.canonical(benchmark)
    if name == "hotpotqa":
        paragraphs = "\n".join(f"{title}: {''.join(sents)}" for title, sents in question.context)
        return f"{question.question}\n{paragraphs}"
    if name == "scienceqa":
        return question.question + (f"\n{image_observation(question)}" if question.has_image else "")
    raise AssertionError(f"no calibration text for benchmark {name!r}")


def calibration(tokenizer, benchmark: str = "hotpotqa", n: int = 4, tokens: int = 128) -> list[list[int]]:
    """Calibration sequences from the first ``n`` train questions of ``benchmark``
    (:func:`calibration_text`), the first ``tokens`` token ids of each. The committed HotpotQA
    profiles were made with ``benchmark="hotpotqa"``, the ScienceQA one with ``"scienceqa"``
    (:func:`calibration_name` says which in the file).

    Raises:
        UnknownBenchmarkError: not a benchmark.
    """
    questions = get_benchmark(benchmark).load_questions("train")[:n]
    return [
        tokenizer(calibration_text(q, benchmark), add_special_tokens=False)["input_ids"][:tokens]
        for q in questions
    ]


def calibration_name(benchmark: str, n: int = 4, tokens: int = 128) -> str:
    """What :func:`calibration` with these arguments is, as the profile records it."""
    return f"{benchmark} train[:{n}], at most {tokens} tokens each"


def adapter_folders(adapters: str, benchmark: str = "hotpotqa") -> dict[str, Path]:
    """The adapter folders by agent of a committed set (``qv``, ``all``) trained on ``benchmark``,
    or of a folder ``DIR/<agent>/`` (whatever the benchmark).

    Raises:
        UnknownBenchmarkError: not a benchmark.
        AdapterError: the set was not trained for the benchmark, or the folder holds no adapter.
    """
    return adapter_set(get_benchmark(benchmark).adapters(adapters))


def _profile_command(args: argparse.Namespace) -> int:
    folders = adapter_folders(args.adapters, args.benchmark)  # checked before the model loads
    model = precache.models.load_model(args.model)
    adapters = {a: load_adapter(folder, model.config, a) for a, folder in folders.items()}
    path = save_profile(
        model,
        adapters,
        n_critical=args.n_critical,
        calibration=calibration(model.tokenizer, args.benchmark),
        calibration_name=calibration_name(args.benchmark),
    )
    logger.info("wrote %s: critical layers %s", path, json.loads(path.read_text())["layers"])
    return 0


def add_profile_command(adapters_sub: argparse._SubParsersAction) -> None:
    """Register ``precache adapters profile-droidspeak --adapters qv|all|DIR [--benchmark
    hotpotqa|scienceqa] [--model DIR] [--n-critical N]``: profile the adapter set (a committed set
    is the one trained on the benchmark) on the base model over the benchmark's first 4 train
    questions (:func:`calibration`) and write ``droidspeak.json`` next to the adapters."""
    p = adapters_sub.add_parser(
        "profile-droidspeak", help="DroidSpeak's critical layers for an adapter set (droidspeak.json)"
    )
    p.add_argument("--adapters", default="qv", help="qv | all (committed sets) | DIR with DIR/<agent>/")
    p.add_argument(
        "--benchmark",
        choices=BENCHMARKS.names,
        default="hotpotqa",
        help="whose committed set (qv, all) and whose first 4 train questions calibrate",
    )
    p.add_argument("--model", help="base checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--n-critical", type=int, default=None, help="layers in the range (default: L / 3)")
    p.set_defaults(func=_profile_command)
