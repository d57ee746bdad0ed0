"""The compiled decode step's attention from this checkout against a git revision's, paired in one
process: ms a decode step of one engine (SmolLM2, fp32, the qv adapters), one session per context,
each round running both attentions on the same session (order ABBA over the rounds).

Processes on a 2-core machine drift by 20-30% from one to the next, more than most changes to
the attention are worth; within one process the two sides share the same weights, pool and
caches. The revision's ``precache/models/step_attention.py`` is loaded from git as a module and
swapped in for the step's ``attend``; with ``--swap attention,inputs,forward`` also its
``precache/cache/step_inputs.py`` (what the step reads and writes: the planner's ``decode_step``,
or before it ``decode_step_inputs`` / ``write_step``) and ``precache/models/step_graph.py``'s
``_Step.forward`` (the step's layers, calling that revision's ``attend``). Each side compiles its own graph once (minutes cold); the
swapped code must take the same arguments and weights as this checkout's. Its value runs reach as
many rows past their keys as its ``VALUE_PAD`` says (none when it has none, as before the pool
kept spare rows).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/decode_attention_ab.py --against 1cd33c7 \\
        --contexts 4000,1000,250 --rounds 8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

import precache
import precache.cache.plan as plan
import precache.cache.step_inputs as step_inputs
import precache.models.step_graph as step_graph

REPO = Path(__file__).resolve().parents[1]
ADAPTERS = REPO / "precache" / "assets" / "adapters" / "smollm2-135m" / "qv"


def module_at(rev: str, path: str):
    """The module at ``path`` as it stood at ``rev``, loaded under a name of its own."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:{path}"], check=True, capture_output=True, text=True
    ).stdout
    spec = importlib.util.spec_from_loader(f"{Path(path).stem}_{rev}", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dynamo looks a traced function's module up by name
    exec(compile(source, f"{path}@{rev}", "exec"), module.__dict__)
    return module


SWAPPABLE = ("attention", "inputs", "forward")


def side_at(rev: str, swap: set[str]) -> dict:
    """What ``swap`` names as it stood at ``rev``: ``attend`` (``precache/models/step_attention.py``),
    ``decode_step`` (``precache/cache/step_inputs.py``, its value runs reaching that revision's
    ``VALUE_PAD`` rows past their keys, 0 where it had none), ``forward``
    (``precache/models/step_graph.py``'s ``_Step.forward``, calling that revision's ``attend``)."""
    attention = module_at(rev, "precache/models/step_attention.py")
    side = {"attend": attention.attend}
    if "inputs" in swap:
        inputs = module_at(rev, "precache/cache/step_inputs.py")
        inputs.VALUE_PAD = getattr(attention, "VALUE_PAD", 0)
        side["decode_step"] = getattr(inputs, "decode_step", None) or _as_step(inputs)
    else:  # this checkout's inputs, the values read as far past their keys as that attention says
        side["VALUE_PAD"] = getattr(attention, "VALUE_PAD", 0)
    if "forward" in swap:
        graph = module_at(rev, "precache/models/step_graph.py")
        graph.attend = attention.attend
        side["forward"] = graph._Step.forward
    return side


class _Step:
    """A step of a revision from before :class:`~precache.models.contract.DecodeStep`: its inputs
    and reads, written by that revision's ``write_step``."""

    def __init__(self, prepared, pool, write_step):
        self.inputs, writes, self.reads = prepared
        self.write = lambda out: write_step(pool, out, writes)


def _as_step(inputs):
    """That revision's ``decode_step_inputs`` (a tuple) and ``write_step`` as a ``decode_step``."""

    def decode_step(model, plans, pool):
        prepared = inputs.decode_step_inputs(model, plans, pool)
        return None if prepared is None else _Step(prepared, pool, inputs.write_step)

    return decode_step


AGENTS = ("plan", "action", "reflect")


def ms_per_step(session, tokens: int, agent: str = "plan") -> float:
    session.append([11, 12])
    turn = session.generate(agent, max_new_tokens=tokens + 1, ignore_eos=True)
    return 1000 * turn.decode_s / (len(turn.token_ids) - 1)


def spread(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="git revision of the other attention")
    parser.add_argument("--contexts", default="4000,1000,250", help="tokens in each session")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="decode steps a side a round")
    parser.add_argument("--method", default="prelrshared")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--agent-turns",
        type=int,
        default=0,
        help="turns of 4 tokens by each agent in turn before the timed rounds (the timed turns are "
        "the planner's): with rebaseownshared-lp its own stores then lie between the base cache's "
        "rows, the gathered layout",
    )
    parser.add_argument(
        "--new-options", type=json.loads, default={}, help="inductor options (JSON) of the new side"
    )
    parser.add_argument(
        "--swap",
        default="attention",
        help=f"what the revision's side brings, comma-separated from {', '.join(SWAPPABLE)} (attention always)",
    )
    args = parser.parse_args()
    swap = {"attention", *args.swap.split(",")}
    if not swap <= set(SWAPPABLE):
        parser.error(
            f"--swap: unknown {', '.join(sorted(swap - set(SWAPPABLE)))}; choose from {', '.join(SWAPPABLE)}"
        )
    torch.set_num_threads(args.threads)
    base = dict(step_graph.INDUCTOR_OPTIONS)
    new = {
        "attend": step_graph.attend,
        "decode_step": step_inputs.decode_step,
        "VALUE_PAD": step_inputs.VALUE_PAD,
        "forward": step_graph._Step.forward,
    }
    sides = {"new": new, "old": {**new, **side_at(args.against, swap)}}
    options = {"new": {**base, **args.new_options}, "old": base}

    layouts: list[str] = []  # the layout of every step the new side's inputs describe

    def recorded(prepare):
        def run(*args):
            out = prepare(*args)
            if out is not None:
                layouts.append("window" if out.inputs.window else "gathered")
            return out

        return run

    def use(side: str) -> None:
        s = sides[side]
        step_graph.attend, step_graph._Step.forward = s["attend"], s["forward"]
        plan.decode_step = recorded(s["decode_step"])
        step_inputs.VALUE_PAD = s["VALUE_PAD"]
        step_graph.INDUCTOR_OPTIONS = options[side]

    model = precache.load_model()
    adapters = {a: ADAPTERS / a for a in AGENTS}
    engine = precache.Engine(model, adapters=adapters, method=args.method)
    contexts = [int(c) for c in args.contexts.split(",")]
    sessions = {}
    gen = torch.Generator().manual_seed(0)
    for n in contexts:
        sessions[n] = engine.session()
        sessions[n].append(torch.randint(10, 10000, (n,), generator=gen).tolist())
        for turn in range(args.agent_turns * len(AGENTS)):
            use(list(sides)[turn % 2])
            ms_per_step(sessions[n], 4, AGENTS[turn % len(AGENTS)])
        # compile each side (and warm it) before any round: twice in turn, so that each side has
        # also run on the layout a session of several turns settles in (ReBaseOwnShared's own
        # stores between the base cache's rows: the gathered layout, a graph of its own)
        for side in [*sides, *sides]:
            use(side)
            ms_per_step(sessions[n], 4)
    times = {(n, s): [] for n in contexts for s in sides}
    seen = {n: set() for n in contexts}  # the layouts of the timed steps
    for r in range(args.rounds):
        order = ["new", "old"] if r % 2 == 0 else ["old", "new"]
        for n in contexts:
            for s in order:
                use(s)
                layouts.clear()
                times[n, s].append(ms_per_step(sessions[n], args.tokens))
                seen[n].update(layouts)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    use("new")
    print(
        f"against {args.against} ({', '.join(sorted(swap))}){' with ' + json.dumps(args.new_options) if args.new_options else ''}, {args.method}{f', {args.agent_turns} turns by each agent first' if args.agent_turns else ''}, {args.rounds} rounds of {args.tokens} steps, ms a step\n"
    )
    print("| context (tokens) | layout | old | new | paired new / old | new faster |")
    print("|---|---|---|---|---|---|")
    for n in contexts:
        ratios = [a / b for a, b in zip(times[n, "new"], times[n, "old"], strict=True)]
        faster = sum(r < 1 for r in ratios)
        print(
            f"| {n:,} | {', '.join(sorted(seen[n]))} | {spread(times[n, 'old'])} | {spread(times[n, 'new'])} | "
            f"{min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f} | {faster}/{len(ratios)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
