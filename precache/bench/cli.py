"""Sub-commands ``precache bench trace | serve | capacity | decode | episodes``, ``precache fidelity`` and ``precache study``.

The model, adapters and engines are loaded only when a command runs.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

import precache
from precache.agents.benchmark import BENCHMARKS, get_benchmark
from precache.bench import report
from precache.bench.capacity import add_bench_capacity
from precache.bench.common import add_common_args, hf_model_of, methods_with_reference, special_ids
from precache.bench.decode import add_bench_decode
from precache.bench.episode_ttft import add_bench_episodes
from precache.bench.episodes import run_fidelity
from precache.bench.hf_peft import METHOD_NAME, HFPeftAgents
from precache.bench.llama_cpp import CONFIGS as LLAMA_CPP_CONFIGS
from precache.bench.llama_cpp import llama_cpp_runners, parse_baselines
from precache.bench.replay import replay_engine
from precache.bench.serve import add_bench_serve
from precache.bench.soak import add_bench_soak
from precache.bench.study.cli import add_study
from precache.bench.suite import run_suite
from precache.bench.trace import check_fits, load_trace, token_stream
from precache.cli_args import add_split_argument, model_options, positive_int
from precache.errors import PrecacheError
from precache.methods import METHODS
from precache.resources import adapter_set, trace_path
from precache.terminal import console

logger = logging.getLogger(__name__)

#: ``bench trace`` replays per method when ``--repeats`` is not given: three for a measurement (the
#: spread RESULTS.md reports), one for the smoke trace, which checks that every method runs
DEFAULT_REPEATS = 3
CHECK_TRACES = {"smoke": 1}


def _bench_trace(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = methods_with_reference(args.methods)
    baselines = [b for b in parse_baselines(args.baselines) if not (args.no_hf_peft and b == METHOD_NAME)]
    llama_configs = [b for b in baselines if b in LLAMA_CPP_CONFIGS]
    if llama_configs and args.device not in (None, "cpu"):
        raise PrecacheError(
            f"--baselines {','.join(llama_configs)}: llama.cpp is built for the CPU here; "
            f"it cannot be compared on --device {args.device}"
        )
    trace = load_trace(trace_path(args.trace))
    adapters = adapter_set(args.adapters, trace.agents)
    # a trace replays token ids: a checkpoint without tokenizer files is enough
    model = precache.load_model(
        args.model,
        max_context=args.max_context,
        device=args.device,
        require_tokenizer=False,
        **model_options(args),
    )
    check_fits(trace, model.max_context)
    stream = token_stream(trace, model.config.vocab_size, special_ids(model), args.seed)
    runners = {}
    for method in methods:
        # every repeat replays the same stream: no trajectory may reuse another's blocks
        engine = precache.Engine(model, adapters=adapters, method=method, prefix_caching=False)
        # every layout of the step compiled before any replay: the warm-up's short turns do not
        # reach them all (ReBaseOwnShared-LP's gathered step compiled inside a timed repeat)
        engine.compile_decode_step()
        runners[method] = lambda tr, st, engine=engine: replay_engine(engine, tr, st)
    if METHOD_NAME in baselines:
        hf_model = hf_model_of(model).to(device=model.device, dtype=model.dtype)  # the engine's device
        runners[METHOD_NAME] = HFPeftAgents(hf_model, adapters, take=True).replay
    repeats = args.repeats = args.repeats or CHECK_TRACES.get(args.trace, DEFAULT_REPEATS)
    with llama_cpp_runners(
        llama_configs, model.path, adapters, model.config, trace, torch.get_num_threads()
    ) as llama_runners:
        runners.update(llama_runners)
        result = run_suite(runners, trace, stream, repeats=repeats)
    result["config"] = {k: v for k, v in vars(args).items() if k != "func"}
    report.write_json(result, args.json)
    out = console()
    out.print(report.trace_table(result))
    out.print(result["latency_note"], style="dim")
    if repeats == 1:
        out.print(
            "one replay per method: a check that each runs, not a measurement (--repeats 3 for figures)",
            style="dim",
        )
    if args.markdown:
        Path(args.markdown).write_text(report.trace_markdown(result), encoding="utf-8")
    if args.plot:
        from precache.bench import plots  # matplotlib: only to draw

        plots.plot_trace(result, args.plot)
    return 0


def _fidelity(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = methods_with_reference(args.methods)
    benchmark = get_benchmark(args.benchmark)
    adapters = adapter_set(benchmark.adapters(args.adapters), ["plan", "action", "reflect"])
    questions = benchmark.load_questions(args.split)[: args.limit]
    model = precache.load_model(args.model, **model_options(args))
    # each method computes every turn itself: the reference and the teacher-forced runs share a prompt
    engines = {m: precache.Engine(model, adapters=adapters, method=m, prefix_caching=False) for m in methods}
    result = run_fidelity(
        engines,
        questions,
        concurrency=args.concurrency,
        max_steps=args.max_steps,
        max_new_tokens=args.max_new_tokens,
        benchmark=benchmark,
    )
    result["config"] = {k: v for k, v in vars(args).items() if k != "func"}
    report.write_json(result, args.json)
    console().print(report.fidelity_table(result))
    if args.markdown:
        Path(args.markdown).write_text(report.fidelity_markdown(result), encoding="utf-8")
    if args.plot_dir:
        from precache.bench import plots  # matplotlib: only to draw

        plots.plot_fidelity(result, args.plot_dir)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``bench`` (``trace``, ``serve``, ``capacity``, ``decode``, ``episodes``, ``soak``),
    ``study`` and ``fidelity`` on the ``precache`` parser."""
    bench = sub.add_parser(
        "bench", help="benchmarks: trace replay, decode speed, serving, capacity, episodes, soak"
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_bench_serve(bench_sub)
    add_bench_capacity(bench_sub)
    add_bench_decode(bench_sub)
    add_bench_episodes(bench_sub)
    add_bench_soak(bench_sub)
    add_study(sub)
    trace = bench_sub.add_parser("trace", help="replay an agent trace with every method, side by side")
    trace.add_argument(
        "--trace",
        required=True,
        help="a shipped trace (paper_L1024, smoke, ...) or a CSV agent,prefill_len,decode_len",
    )
    trace.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help=f"timed replays per method, median reported (default {DEFAULT_REPEATS}; 1 for the smoke trace)",
    )
    trace.add_argument("--seed", type=int, default=0, help="seed of the appended random token stream")
    trace.add_argument("--plot", help="PNG: TTFT per turn and KV bytes over the trajectory")
    trace.add_argument(
        "--baselines",
        default=METHOD_NAME,
        help="comma-separated: hf-peft (HF transformers + PEFT), llama-cpp (llama-server at f32 and "
        "q8_0, one slot per agent and one slot; needs `make llama-cpp`) or one llama-cpp-* "
        "configuration (default: hf-peft)",
    )
    trace.add_argument("--no-hf-peft", action="store_true", help="leave hf-peft out of --baselines")
    trace.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="tokens of RoPE tables past the model's own length (paper_L4096 needs 17,296 on SmolLM2's 8,192)",
    )
    trace.add_argument("--device", default=None, help="torch device, e.g. cuda (bf16 there; default: CPU)")
    add_common_args(trace, ",".join(METHODS))
    trace.set_defaults(func=_bench_trace)

    fidelity = sub.add_parser("fidelity", help="KL, top-1, base-cache error and answers vs NonShared")
    fidelity.add_argument("--benchmark", default="hotpotqa", help=" | ".join(BENCHMARKS.names))
    add_split_argument(fidelity)
    fidelity.add_argument("--limit", type=positive_int, default=None, help="first N questions of the split")
    fidelity.add_argument("--max-steps", type=int, default=8, help="plan steps per episode")
    fidelity.add_argument("--max-new-tokens", type=int, default=64, help="tokens per agent turn")
    fidelity.add_argument("--plot-dir", help="folder for layer_error.png and kl_per_turn.png")
    fidelity.add_argument(
        "--concurrency",
        type=positive_int,
        default=1,
        help="questions run at once, their forwards batched per engine",
    )
    add_common_args(fidelity, ",".join(METHODS))
    fidelity.set_defaults(func=_fidelity)
