"""Sub-commands: ``precache adapters list | train | check | profile-droidspeak``, ``precache run``
and ``precache eval``.

``run`` and ``eval`` drive the precache engine (``precache.Engine``, ``precache.load_model``).
Every argument that can be checked without the model (method, adapters, question files) is
checked before the model loads.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from rich.table import Table

import precache
from precache.agents import prompt
from precache.agents.benchmark import BENCHMARKS, get_benchmark
from precache.agents.calibration import add_profile_command
from precache.agents.data import (
    DatasetError,
    Question,
    get_question,
    load_question_file,
    parse_context,
)
from precache.agents.evaluate import evaluate
from precache.agents.formcheck import format_markdown, formcheck_markdown, run_formcheck
from precache.agents.loop import run_episode
from precache.agents.train import train_adapters
from precache.cli_args import add_dtype_argument, add_split_argument, model_options, positive_int
from precache.errors import AdapterError
from precache.methods import METHOD_REGISTRY
from precache.resources import ADAPTER_ROOT, ADAPTER_SETS, adapter_set
from precache.terminal import console

logger = logging.getLogger(__name__)

REFERENCE_METHOD = "nonshared"


def _list(args: argparse.Namespace) -> int:
    table = Table("benchmark", "set", "agent", "rank", "alpha", "target modules", "folder")
    for benchmark in BENCHMARKS.values():
        for name in ADAPTER_SETS:
            try:
                folders = adapter_set(benchmark.adapters(name))
            except AdapterError:
                continue  # not trained for this benchmark
            for agent, folder in folders.items():
                config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
                modules = config.get("target_modules") or []
                table.add_row(
                    benchmark.name,
                    name,
                    agent,
                    str(config.get("r")),
                    str(config.get("lora_alpha")),
                    ",".join(sorted(modules)) if isinstance(modules, list) else str(modules),
                    str(folder),
                )
    console().print(table)
    return 0


def _train(args: argparse.Namespace) -> int:
    benchmark = get_benchmark(args.benchmark)
    out = Path(args.out) if args.out else benchmark.adapter_root / args.set
    train_adapters(
        out,
        targets=args.set,
        steps=args.steps,
        seed=args.seed,
        benchmark=benchmark,
        save_dtype=args.save_dtype,
    )
    return 0


def _check(args: argparse.Namespace) -> int:
    reports = run_formcheck({name: ADAPTER_ROOT / name for name in args.set}, limit=args.limit)
    for name, report in reports.items():
        data = json.dumps(report, indent=1) + "\n"
        (ADAPTER_ROOT / name / "FORMCHECK.json").write_text(data, encoding="utf-8")
    (ADAPTER_ROOT / "FORMCHECK.md").write_text(formcheck_markdown(ADAPTER_ROOT), encoding="utf-8")
    for name, report in reports.items():
        console().print(format_markdown(name, report))
    return 0


def _engine(args: argparse.Namespace, method: str, adapters: dict[str, Path], model=None):
    """A precache engine with ``adapters``; loads ``args.model`` unless given ``model``."""
    if model is None:
        model = precache.load_model(args.model, **model_options(args))
    return precache.Engine(model, adapters=adapters, method=method)


def custom_question(text: str, paragraphs: str | Path, answer: str) -> Question:
    """A question of your own over paragraphs from a JSON file: ``[[title, [sentence, ...]], ...]``
    (HotpotQA's ``context``), or ``{"context": [...]}``; plain sentences are joined with a space,
    as HotpotQA's read (:func:`~precache.agents.data.parse_context` with ``add_spaces``).

    Raises:
        DatasetError: the file is missing or not JSON, or the paragraphs have another shape; the
            message names the file and the field.
    """
    path = Path(paragraphs).expanduser()
    if not path.is_file():
        raise DatasetError(f"no paragraphs file {path}")
    try:
        context = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not JSON ({exc})") from None
    if isinstance(context, dict):
        others = [k for k in context if k != "context"]
        if others:
            raise DatasetError(
                f"{path}: field(s) {', '.join(map(repr, others))} are not read by --paragraphs, which takes "
                '[[title, [sentence, ...]], ...] or {"context": ...} (whole records: eval --data FILE)'
            )
        context = context.get("context")
    return Question(
        id="custom",
        question=text,
        answer=answer,
        type="",
        level="",
        supporting_facts=(),
        context=parse_context(context, str(path), add_spaces=True),
    )


def _scores(benchmark, episode, question) -> str:
    """``answer=... gold=... EM=1 F1=1.00`` (HotpotQA) or ``answer=... gold=B accuracy=1`` (ScienceQA)."""
    if benchmark.name == "scienceqa":
        return f"answer={episode.answer!r} gold={question.answer!r} accuracy={episode.accuracy:.0f}"
    return f"answer={episode.answer!r} gold={question.answer!r} EM={episode.em:.0f} F1={episode.f1:.2f}"


def _hotpotqa_only(benchmark, args: argparse.Namespace, options: tuple[str, ...]) -> None:
    given = [f"--{name}" for name in options if getattr(args, name, None) is not None]
    if given and benchmark.name != "hotpotqa":
        raise DatasetError(
            f"{', '.join(given)} take(s) HotpotQA questions: not with --benchmark {benchmark.name}"
        )


def _run(args: argparse.Namespace) -> int:
    METHOD_REGISTRY.canonical(args.method)  # an unknown method is refused before the model loads
    benchmark = get_benchmark(args.benchmark)
    _hotpotqa_only(benchmark, args, ("paragraphs", "answer"))
    if benchmark.name != "hotpotqa":
        question = benchmark.get_question(args.question)
    elif args.paragraphs:
        question = custom_question(args.question, args.paragraphs, args.answer or "")
    elif args.answer is not None:
        raise DatasetError("--answer is the gold answer of a question text: it needs --paragraphs")
    else:
        try:
            question = get_question(args.question)
        except DatasetError as exc:
            raise DatasetError(f"{exc}; pass --paragraphs FILE to ask a question of your own") from None
    adapters = adapter_set(benchmark.adapters(args.adapters), prompt.ROLES)
    engine = _engine(args, args.method, adapters)
    episode = run_episode(
        engine.session(),
        question,
        max_steps=args.max_steps,
        max_new_tokens=args.max_new_tokens,
        benchmark=benchmark,
    )
    out = console()
    out.print(episode.trajectory, markup=False, highlight=False)
    table = Table("agent", "TTFT ms", "prefill tokens", "new tokens", "stop")
    for turn in episode.turns:
        table.add_row(
            turn.agent,
            f"{turn.ttft_s * 1e3:.1f}",
            str(turn.prefill_tokens),
            str(turn.new_tokens),
            turn.stop_reason,
        )
    out.print(table)
    out.print(f"{_scores(benchmark, episode, question)} stop={episode.stop_reason}")
    if args.json:
        data = {"method": args.method, "adapters": args.adapters, **episode.to_dict()}
        if benchmark.name != "hotpotqa":
            data = {"benchmark": benchmark.name, **data}
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return 0


def _eval(args: argparse.Namespace) -> int:
    METHOD_REGISTRY.canonical(args.method)
    benchmark = get_benchmark(args.benchmark)
    _hotpotqa_only(benchmark, args, ("data",))
    adapters = adapter_set(benchmark.adapters(args.adapters), prompt.ROLES)
    source = args.data or args.split
    if args.data:
        questions = load_question_file(args.data)[: args.limit]
    else:
        questions = benchmark.load_questions(args.split)[: args.limit]
    engine = _engine(args, args.method, adapters)
    reference = None
    if args.method != REFERENCE_METHOD:
        reference = _engine(args, REFERENCE_METHOD, adapters, model=engine.model).session
    result = evaluate(
        engine.session,
        questions,
        reference_session=reference,
        concurrency=args.concurrency,
        benchmark=benchmark,
        max_steps=args.max_steps,
        max_new_tokens=args.max_new_tokens,
    )
    result["config"] = {k: v for k, v in vars(args).items() if k != "func"}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    summary = result["summary"]
    agreement = summary.get("agreement", 1.0)
    metrics = " ".join(
        f"{'accuracy' if m == 'accuracy' else m.upper()}={summary[m]:.3f}" for m in benchmark.metrics
    )
    where = source if benchmark.name == "hotpotqa" else f"{benchmark.name} {source}"
    console().print(
        f"{args.method} on {len(questions)} questions of {where}: {metrics} "
        f"agreement with {REFERENCE_METHOD}={agreement:.3f}"
    )
    return 0


def _benchmark_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--benchmark",
        choices=BENCHMARKS.names,
        default="hotpotqa",
        help="hotpotqa (EM / F1) or scienceqa (option accuracy); committed adapter sets are per benchmark",
    )


def _engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--method", default="prelrshared", help="sharing method: " + ", ".join(METHOD_REGISTRY.names)
    )
    parser.add_argument(
        "--adapters",
        default="qv",
        help="qv | all (committed sets) | DIR with DIR/plan, DIR/action, DIR/reflect",
    )
    parser.add_argument("--model", help="base checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    add_dtype_argument(parser)
    parser.add_argument("--max-steps", type=int, default=8, help="plan steps per episode")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per agent turn")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``adapters``, ``run`` and ``eval`` on the ``precache`` parser."""
    adapters = sub.add_parser("adapters", help="list, train or check the plan / action / reflect adapters")
    adapters_sub = adapters.add_subparsers(dest="adapters_command", required=True)
    listing = adapters_sub.add_parser(
        "list", help="the committed adapter sets per benchmark: agents, rank, targets, folder"
    )
    listing.set_defaults(func=_list)
    train = adapters_sub.add_parser("train", help="train one adapter set on gold trajectories of a benchmark")
    _benchmark_option(train)
    train.add_argument("--set", choices=ADAPTER_SETS, default="qv", help="projections the LoRA targets")
    train.add_argument("--steps", type=int, default=60, help="optimizer steps per role (batch 4; default 60)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--save-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the saved adapter files (default float32; trained in fp32; the committed `all` "
        "sets are bfloat16)",
    )
    train.add_argument(
        "--out",
        help="output folder (default: the committed set's folder in the package, whose files it replaces)",
    )
    train.set_defaults(func=_train)
    check = adapters_sub.add_parser("check", help="form check of each role with and without its adapter")
    check.add_argument("--set", nargs="+", choices=ADAPTER_SETS, default=["qv"], help="one or both sets")
    check.add_argument("--limit", type=int, default=20, help="dev questions to check")
    check.set_defaults(func=_check)
    add_profile_command(adapters_sub)  # `adapters profile-droidspeak` (DroidSpeak's critical layers)

    run = sub.add_parser("run", help="answer one HotpotQA or ScienceQA question with the three agents")
    run.add_argument(
        "--question",
        required=True,
        help="a HotpotQA id, a ScienceQA pid (--benchmark scienceqa), or a question text with --paragraphs",
    )
    run.add_argument(
        "--paragraphs",
        help='JSON file [[title, [sentence, ...]], ...] or {"context": ...} for a question text',
    )
    run.add_argument("--answer", help="gold answer of a question text (for EM / F1)")
    run.add_argument("--json", help="write the episode (turns, trajectory, scores) to this file")
    _benchmark_option(run)
    _engine_options(run)
    run.set_defaults(func=_run)

    evaluation = sub.add_parser(
        "eval",
        help="EM / F1 (HotpotQA) or option accuracy (ScienceQA), agreement with NonShared, on a split",
    )
    _benchmark_option(evaluation)
    questions = evaluation.add_mutually_exclusive_group()
    add_split_argument(questions)
    questions.add_argument(
        "--data", help="questions of your own: HotpotQA records, one a line (.jsonl) or a JSON list"
    )
    evaluation.add_argument("--limit", type=positive_int, default=None, help="first N questions")
    evaluation.add_argument("--json", required=True, help="results file")
    evaluation.add_argument(
        "--concurrency", type=positive_int, default=1, help="episodes run at once, their forwards batched"
    )
    _engine_options(evaluation)
    evaluation.set_defaults(func=_eval)
