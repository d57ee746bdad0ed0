"""The prepared GPU benchmark (``benchmarks/gpu/run.sh``): three parts, one results folder.

1. the ``triton`` kernel against SDPA on the same lengths (:mod:`precache.bench.gpu_kernel`);
2. the paper's trace ``paper_L4096`` for every method and the HF + PEFT baseline
   (:func:`precache.bench.suite.run_suite`): sum of TTFT, latency, throughput, peak KV, and
   PreLRShared's TTFT speed-up over NonShared against the prefill-token ceiling (NonShared's
   prefill tokens / PreLRShared's);
3. concurrent trajectories (32 and 128, in-process through :meth:`Engine.run_concurrently`, as
   ``bench serve`` drives the same scheduler over HTTP): throughput and p90 TTFT for NonShared,
   PreLRShared, ReBaseShared LP and DB.

Nothing is downloaded: the model is randomly initialised from a config shaped like Llama-3.1-8B
(bf16 on CUDA), with three random rank-8 q/v adapters and three on all seven projections, saved
as PEFT folders under the results folder. ``--dry-run`` runs the same code on CPU with a tiny
config and tiny lengths (the kernel through Triton's interpreter). A time budget skips what would
not fit (recorded as skipped, never as a number).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

import precache
from precache.bench.gpu_kernel import kernel_vs_sdpa
from precache.bench.gpu_report import write_report
from precache.bench.hf_peft import METHOD_NAME, HFPeftAgents
from precache.bench.replay import replay_engine
from precache.bench.suite import run_suite
from precache.bench.trace import Trace, load_trace, token_stream
from precache.models import model_from_hf
from precache.resources import trace_path

logger = logging.getLogger(__name__)

AGENTS = ("plan", "action", "reflect")
TRACE_METHODS = ("nonshared", "fullshared", "baseshared", "prelrshared", "rebaseshared-lp", "rebaseshared-db")
LOAD_METHODS = ("nonshared", "prelrshared", "rebaseshared-lp", "rebaseshared-db")
TTFT_TARGET = 0.95  # PreLRShared's TTFT speed-up over NonShared / the prefill-token ceiling
LLAMA_31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=False,
)
TINY = dict(LLAMA_31_8B, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
TINY.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def random_model(dry_run: bool, device: str, max_context: int):
    """Our model over a randomly initialised HF Llama (``(model, hf_model)``, weights shared)."""
    cfg = LlamaConfig(**(TINY if dry_run else LLAMA_31_8B))
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return model_from_hf(hf, device=device, max_context=max_context), hf


def save_adapters(model, folder: Path, targets: tuple[str, ...], rank: int = 8, seed: int = 0) -> dict:
    """Random PEFT LoRA folders ``folder/<agent>/`` (``A ~ N(0, 1/d_in)``, ``B ~ N(0, 0.02^2)``) for
    every agent; returns them by agent name."""
    c = model.config
    sizes = {
        "q_proj": (c.hidden_size, c.num_heads * c.head_dim),
        "k_proj": (c.hidden_size, c.num_kv_heads * c.head_dim),
        "v_proj": (c.hidden_size, c.num_kv_heads * c.head_dim),
        "o_proj": (c.num_heads * c.head_dim, c.hidden_size),
        "gate_proj": (c.hidden_size, c.intermediate_size),
        "up_proj": (c.hidden_size, c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size),
    }
    gen = torch.Generator().manual_seed(seed)
    dirs = {}
    for agent in AGENTS:
        tensors = {}
        for layer in range(c.num_layers):
            for proj in targets:
                d_in, d_out = sizes[proj]
                part = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, d_in, generator=gen) / d_in**0.5).to(
                    model.dtype
                )
                tensors[f"{key}.lora_B.weight"] = (torch.randn(d_out, rank, generator=gen) * 0.02).to(
                    model.dtype
                )
        out = folder / agent
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets)}
        (out / "adapter_config.json").write_text(json.dumps({**config, "lora_dropout": 0.0}))
        dirs[agent] = out
    return dirs


def _engine(model, adapters, method: str, kv_bytes: int, max_running: int = 64):
    return precache.Engine(
        model,
        adapters=adapters,
        method=method,
        kv_cache_bytes=kv_bytes,
        prefix_caching=False,
        max_running=max_running,
        max_step_tokens=8192,
    )


def _kv_budget(model, tokens: int) -> int:
    """Bytes for ``tokens`` positions of full K/V plus LR columns of every agent (rank <= 16)."""
    c = model.config
    return (
        tokens
        * c.num_layers
        * (2 * c.num_kv_heads * c.head_dim + 2 * 16 * len(AGENTS))
        * model.dtype.itemsize
    )


def trace_part(model, hf, adapters: dict, trace: Trace) -> dict:
    """Every method and hf-peft on ``trace``, one repeat after a warm-up (engines built one at a time)."""
    stream = token_stream(trace, model.config.vocab_size, [], seed=0)
    kv_bytes = _kv_budget(model, (len(AGENTS) + 1) * trace.total_tokens + 4096)

    def runner(method):
        return lambda tr, st: replay_engine(_engine(model, adapters, method, kv_bytes), tr, st)

    runners = {m: runner(m) for m in TRACE_METHODS}
    skipped = []
    try:
        runners[METHOD_NAME] = HFPeftAgents(hf, adapters).replay
    except ImportError as exc:  # peft missing on this machine
        skipped.append(f"hf-peft: {exc}")
    result = run_suite(runners, trace, stream, repeats=1)
    methods = result["methods"]
    ns, pre = methods["nonshared"]["median"], methods["prelrshared"]["median"]
    ceiling = ns["prefill_tokens"] / pre["prefill_tokens"]
    speedup = ns["ttft_s"] / pre["ttft_s"]
    result["ttft_target"] = {
        "prefill_token_ceiling": ceiling,
        "prelrshared_ttft_speedup": speedup,
        "fraction_of_ceiling": speedup / ceiling,
        "target": TTFT_TARGET,
        "met": speedup / ceiling >= TTFT_TARGET,
    }
    result["skipped"] = skipped
    return result


def load_part(model, adapters: dict, levels: tuple[int, ...], trace: Trace, seconds_left) -> dict:
    """``levels`` concurrent trajectories of ``trace`` per method; levels that would pass the time
    budget are skipped (listed)."""
    out, skipped = {}, []
    for level in levels:
        for method in LOAD_METHODS:
            if seconds_left() < 30:
                skipped.append(f"{method} x{level}: time budget")
                continue
            engine = _engine(
                model, adapters, method, _kv_budget(model, 3 * level * trace.total_tokens), level
            )
            streams = [token_stream(trace, model.config.vocab_size, [], seed=i + 1) for i in range(level)]
            t0 = time.perf_counter()
            replays = engine.run_concurrently(lambda s, e=engine: replay_engine(e, trace, s), streams, level)
            wall = time.perf_counter() - t0
            ttfts = sorted(t.ttft_s for r in replays for t in r.turns)
            out.setdefault(str(level), {})[method] = {
                "trajectories": level,
                "wall_s": wall,
                "throughput_tok_s": level * trace.total_tokens / wall,
                "p50_ttft_s": statistics.median(ttfts),
                "p90_ttft_s": ttfts[min(len(ttfts) - 1, math.ceil(0.9 * len(ttfts)) - 1)],
                "turns": len(ttfts),
            }
            del engine
    db_vs_lp = {
        lv: r["rebaseshared-db"]["throughput_tok_s"] / r["rebaseshared-lp"]["throughput_tok_s"]
        for lv, r in out.items()
        if "rebaseshared-db" in r and "rebaseshared-lp" in r
    }
    return {
        "trace": trace.name,
        "trace_tokens": trace.total_tokens,
        "levels": out,
        "db_over_lp_throughput": db_vs_lp,
        "skipped": skipped,
    }


def machine(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__}
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
    try:
        import triton  # the optional extra

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def _guarded(result: dict, where: dict, name: str, fn, out: Path, t_start: float) -> None:
    """``where[name] = fn()``; an exception is recorded there (``{"error": ...}``, traceback logged)
    instead of ending the run, and the report is rewritten after every part (a run cut short still
    leaves what it measured)."""
    try:
        where[name] = fn()
    except Exception as exc:  # one GPU attempt: keep the other parts' numbers
        logger.exception("part %s failed", name)
        where[name] = {"error": f"{type(exc).__name__}: {exc}"}
    result["seconds"] = time.perf_counter() - t_start
    write_report(result, out)


def run(out: Path, dry_run: bool, device: str, budget_s: float) -> dict:
    """All three parts; writes ``gpu.json``, ``gpu.md`` and ``gpu.png`` under ``out`` after each.
    A part that raises is recorded as ``{"error": ...}`` and the next one runs. They run in the
    order trace (q/v adapters), load, trace (all-projection adapters, if at least 30% of the budget
    is left), kernel: the kernel part runs whatever the budget, last, so that a fault in it leaves
    the others' figures."""
    t_start = time.perf_counter()

    def seconds_left() -> float:
        return budget_s - (time.perf_counter() - t_start)

    trace = load_trace(trace_path("paper_L4096"))
    load_trace_ = load_trace(trace_path("short_turns")).head(3, 64)
    if dry_run:
        trace = trace.head(3, 8)
        load_trace_ = load_trace_.head(2, 6)
    max_context = 48 * 1024 if not dry_run else 512
    model, hf = random_model(dry_run, device, max_context)
    result = {
        "dry_run": dry_run,
        "machine": machine(device),
        "model": "Llama-3.1-8B-shaped, random" if not dry_run else "tiny random Llama",
        "kernel": {"skipped": "not run yet"},
        "trace": {},
        "load": {"skipped": "not run yet"},
    }
    sets = {
        "qv": ("q_proj", "v_proj"),
        "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    }
    adapters = {
        name: save_adapters(model, out / "adapters" / name, t, seed=i)
        for i, (name, t) in enumerate(sets.items())
    }
    # the kernel's own cases last: a fault there poisons the CUDA context for every later part
    # (the first H200 run lost the trace and load parts so), and the parts before it are on disk
    _guarded(
        result, result["trace"], "qv", lambda: trace_part(model, hf, adapters["qv"], trace), out, t_start
    )
    levels = (2, 3) if dry_run else (32, 128)
    run_load = lambda: load_part(model, adapters["qv"], levels, load_trace_, seconds_left)  # noqa: E731
    _guarded(result, result, "load", run_load, out, t_start)
    if dry_run or seconds_left() < 0.3 * budget_s:
        result["trace"]["all"] = {"skipped": "dry run" if dry_run else "time budget"}
    else:
        run_all = lambda: trace_part(model, hf, adapters["all"], trace)  # noqa: E731
        _guarded(result, result["trace"], "all", run_all, out, t_start)
    logger.info("trace and load parts done after %.0f s", budget_s - seconds_left())
    _guarded(result, result, "kernel", lambda: kernel_vs_sdpa(model, dry_run), out, t_start)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results folder (gpu.json, gpu.md, gpu.png, adapters/)")
    parser.add_argument("--dry-run", action="store_true", help="tiny config on CPU, kernel interpreted")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --dry-run")
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="seconds before later parts are skipped"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = args.device or ("cpu" if args.dry_run else "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(out, args.dry_run, device, args.budget_s)
    logger.info("done in %.0f s: %s", result["seconds"], out / "gpu.md")
    failed = [k for k in ("kernel", "load") if "error" in result[k]]
    failed += [f"trace {k}" for k, v in result["trace"].items() if "error" in v]
    if failed:
        logger.error("parts that failed (recorded in gpu.json): %s", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
