"""Where a decode step goes: wall time per part of ``Engine.step`` at batch 1 and 16, per method.

Each side: SmolLM2 with the committed ``qv`` adapters, ``batch`` trajectories of ``--context``
random tokens prefilled by the ``plan`` agent, then ``--steps`` decode steps of the ``action``
agent, timed. The parts are measured by wrapping the engine's functions in wall clocks (nested
parts are subtracted from their parent; a wrapper costs about a microsecond a call):

- ``scheduler``: ``Engine.step`` minus what it calls below (admission, rows, plans, bookkeeping);
- ``metadata``: ``run_plans`` minus the model's forward (block reservation, attention metadata,
  the lengths' commit);
- ``weights matmuls``: ``models.llama.linear`` (``F.linear`` before it existed): the forward's projections (q/k/v fused, o, gate/up fused,
  down) and the LM head;
- ``attention + LR``: ``PlannedAttention.attend`` (the cache writes: base K/V and every agent's LR
  rows, then the backend: reads, LR terms ``s (P Lv) B`` and ``RoPE(s Lk B)``, softmax);
- ``LoRA deltas``: ``add_lora`` on the projections (the adapter's ``s (x A) B``);
- ``other forward``: the rest of the forward (norms, RoPE of q, activations, residuals, per-layer
  Python);
- ``sampler + detokenizer``: ``Request.sample``.

    python benchmarks/decode_profile.py --methods nonshared,fullshared,prelrshared --batch 1,16

``--per-row-decode`` runs every decode row's attention alone (the torch backend before decode rows
were batched, issue 22), for an A/B in one process.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

import precache
from precache.cache import plan as plan_module
from precache.cache.attention import TorchBackend
from precache.cache.planned_attention import PlannedAttention
from precache.engine.request import Request
from precache.models import llama
from precache.resources import adapter_set

PARTS = (
    "scheduler",
    "metadata",
    "weights matmuls",
    "attention + LR",
    "LoRA deltas",
    "other forward",
    "sampler + detokenizer",
)


class Clock:
    """Wall time per wrapped function, exclusive of the wrapped functions it calls."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []
        self.on = False

    def wrap(self, owner, attr: str, name: str):
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            frame = [time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                spent = time.perf_counter() - frame[0]
                self.total[name] += spent - frame[1]
                if self.stack:
                    self.stack[-1][1] += spent

        setattr(owner, attr, timed)
        return fn

    @contextmanager
    def running(self):
        self.on = True
        try:
            yield
        finally:
            self.on = False


def profile(
    engine, agent_prefill: str, agent_decode: str, batch: int, context: int, steps: int, clock: Clock
):
    gen = torch.Generator().manual_seed(0)
    sessions = []
    for _ in range(batch):
        s = engine.session()
        s.append(torch.randint(100, 40000, (context,), generator=gen).tolist())
        sessions.append(s)
    engine.wait_all(
        [
            engine.submit(Request(s, agent_prefill, s.validate(agent_prefill, {"max_new_tokens": 1})))
            for s in sessions
        ]
    )
    params = {"max_new_tokens": steps + 3, "temperature": 0.0, "ignore_eos": True}
    requests = [engine.submit(Request(s, agent_decode, s.validate(agent_decode, params))) for s in sessions]
    engine.step()  # admission and the prefill of the appended token: not timed
    engine.step()
    clock.total.clear()
    with clock.running():
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    engine.wait_all(requests)
    parts = {
        "scheduler": clock.total["step"],
        "metadata": clock.total["run_plans"],
        "weights matmuls": clock.total["linear"],
        "attention + LR": clock.total["attend"],
        "LoRA deltas": clock.total["add_lora"],
        "other forward": clock.total["forward"],
        "sampler + detokenizer": clock.total["sample"],
    }
    return wall / steps, {k: v / steps for k, v in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="nonshared,fullshared,prelrshared")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--context", type=int, default=256, help="tokens before decoding starts")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", default=None, choices=("int8",), help="int8 weight-only")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode steps as one compiled graph (precache's default on a CPU)",
    )
    parser.add_argument(
        "--per-row-decode", action="store_true", help="attend each decode row alone (no padded batches)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = precache.load_model(
        dtype=getattr(torch, args.dtype), quantization=args.quantization, compile=args.compile
    )
    clock = Clock()
    clock.wrap(precache.Engine, "step", "step")
    clock.wrap(plan_module, "run_plans", "run_plans")
    clock.wrap(type(model), "forward", "forward")
    # the projections and the LM head (``models.llama.linear``, or ``F.linear`` in older code)
    if hasattr(llama, "linear"):
        clock.wrap(llama, "linear", "linear")
    else:
        clock.wrap(torch.nn.functional, "linear", "linear")
    clock.wrap(PlannedAttention, "attend", "attend")
    clock.wrap(llama, "add_lora", "add_lora")
    clock.wrap(Request, "sample", "sample")
    import precache.engine.engine as engine_module

    engine_module.run_plans = plan_module.run_plans  # the engine's own reference
    rows = []
    for method in args.methods.split(","):
        engine = precache.Engine(model, adapters=adapter_set("qv"), method=method, prefix_caching=False)
        if args.per_row_decode:
            engine.attention = TorchBackend(batch_decode=False)
        for batch in (int(b) for b in args.batch.split(",")):
            step_s, parts = profile(engine, "plan", "action", batch, args.context, args.steps, clock)
            rows.append((method, batch, step_s, parts))
    print(
        f"decode step, SmolLM2 {args.dtype}{' int8 weights' if args.quantization else ''}, qv adapters, {args.context} tokens of context, {args.threads} threads{', per-row decode attention' if args.per_row_decode else ''}{', compiled decode step' if args.compile else ', eager'}"
    )
    print("| method | batch | step (ms) | tok/s | " + " | ".join(PARTS) + " |")
    print("|---|---|---|---|" + "---|" * len(PARTS))
    for method, batch, step_s, parts in rows:
        cells = " | ".join(f"{1000 * parts[p]:.1f}" for p in PARTS)
        print(f"| {method} | {batch} | {1000 * step_s:.1f} | {batch / step_s:.1f} | {cells} |")


if __name__ == "__main__":
    main()
