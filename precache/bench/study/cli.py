"""The command line of ``precache study`` (:mod:`precache.bench.study`): its flags, checked before
the model loads, and the run over every benchmark x adapter set that writes the report."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from pathlib import Path

import torch

import precache
from precache.agents.benchmark import get_benchmark
from precache.bench import report
from precache.bench.common import methods_with_reference
from precache.bench.study.run import run_study
from precache.bench.study.store import StoredResultsError
from precache.cli_args import add_split_argument, positive_int
from precache.errors import AdapterError
from precache.lora.adapter import load_adapter
from precache.methods import METHODS
from precache.resources import adapter_set
from precache.terminal import console

logger = logging.getLogger(__name__)

ROLES = ("plan", "action", "reflect")


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


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse flags that would have no effect, and unknown methods, before the model loads."""
    if args.report_only and args.concurrency != 1:
        raise StoredResultsError("--report-only runs nothing: --concurrency would have no effect")
    if args.report_only and args.shard is not None:
        raise StoredResultsError("--report-only runs nothing: --shard would have no effect")
    if args.methods is not None:
        methods_with_reference(args.methods)


def _run_set(args: argparse.Namespace, model, bench, name: str, folders: dict, out: Path):
    """``(folder, settings, study)`` of one benchmark x adapter set (:func:`run_study`)."""
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
    return folder, settings, study


def _run_all(args: argparse.Namespace, model, runs: list[tuple], skipped: list[str], out: Path) -> dict:
    """``{"skipped", "runs": {"benchmark/set": run}}`` over every benchmark x adapter set (nothing
    under ``runs`` with ``--shard``: the report waits for ``--report-only``)."""
    results = {"skipped": skipped, "runs": {}}
    for bench, name, folders in runs:
        folder, settings, study = _run_set(args, model, bench, name, folders, out)
        if args.shard is not None:
            continue
        if study is None:
            results["skipped"].append(f"skipped {bench.name} x {name}: nothing stored under {folder}")
            logger.warning(results["skipped"][-1])
            continue
        results["runs"][f"{bench.name}/{name}"] = {
            "benchmark": bench.name,
            "adapters": name,
            "metrics": list(bench.metrics),
            "settings": {**settings, "methods": ",".join(settings["methods"])},
            **study,
        }
    return results


def _report_config(args: argparse.Namespace, runs: dict) -> dict:
    """The command's flags as the report states them: with ``--report-only`` the scales it covers
    (not the defaults of flags that ran nothing), and the run settings the runs used where the
    command left them to the store."""
    config = {k: v for k, v in vars(args).items() if k != "func"}
    if args.report_only:
        config["scales"] = sorted({float(x) for run in runs.values() for x in run["sweep"]})
        del config["concurrency"]
    for key in RUN_SETTINGS:
        if config[key] is None:
            used = {run["settings"][key] for run in runs.values()}
            config[key] = used.pop() if len(used) == 1 else "per run"
    return config


def _study(args: argparse.Namespace) -> int:
    from precache.bench.study import plots  # matplotlib: only to draw the report

    _check_flags(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    runs, skipped = plan_runs(args.benchmark, args.adapters)
    for note in skipped:
        logger.warning(note)
    # eager: the stored points were run eager, and a resumed point must not mix two decode paths
    # (the compiled step's logits differ from eager's by float rounding, which can flip a near-tie)
    model = precache.load_model(args.model, compile=False)
    out = Path(args.out)
    results = _run_all(args, model, runs, skipped, out)
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
    results["config"] = _report_config(args, results["runs"])
    report.write_json(results, out / "study.json")
    markdown = plots.study_markdown(results)
    (out / "study.md").write_text(markdown, encoding="utf-8")
    plots.plot_study(results, out)
    console().print(markdown)
    return 0


def add_study(sub: argparse._SubParsersAction) -> None:
    """Register ``precache study`` on the ``precache`` parser."""
    study = sub.add_parser(
        "study", help="the paper's comparison: table, Figure 2 errors, adapter-strength sweep"
    )
    _add_selection(study)
    _add_running(study)
    study.set_defaults(func=_study)


def _add_selection(study: argparse.ArgumentParser) -> None:
    """What the study covers: benchmarks, adapter sets, methods, questions."""
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
    add_split_argument(study)
    study.add_argument("--limit", type=positive_int, default=None, help="first N questions of the split")


def _add_running(study: argparse.ArgumentParser) -> None:
    """How it runs and where it stores: concurrency, shards, the sweep, episode length, --out."""
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
