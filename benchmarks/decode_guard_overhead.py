"""What dynamo spends before each compiled decode step runs: its guard check ("TorchDynamo Cache
Lookup" in torch's profiler), in ms a step, at batch 1 (PreLRShared, the ``qv`` adapters'
``action`` agent, a random 256-token prompt, the trajectory's keys in two runs of the pool
behind a prefix cached by another trajectory), over three rounds of 32 steps after a warm-up that
compiles the graphs (cold: minutes; cached on disk after).

    python benchmarks/decode_guard_overhead.py

To compare two trees, run it from each (``PYTHONPATH=<tree> python <tree>/benchmarks/...``).
"""

import torch
from torch.profiler import profile

import precache
from precache.bench.decode import engine_decode
from precache.compute import on_compute
from precache.methods import METHOD_REGISTRY
from precache.resources import adapter_set


def main() -> None:
    torch.set_num_threads(2)
    model = precache.load_model(compile=True)
    adapters = adapter_set("qv", ["action"])
    engine = precache.Engine(
        model, adapters={"action": adapters["action"]}, method=METHOD_REGISTRY.canonical("prelrshared")
    )
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 10_000, (256,), generator=g).tolist()
    engine_decode(engine, "action", [prompt], 4)  # compiles the one-run graph
    engine_decode(engine, "action", [prompt], 4)  # the prompt now cached: the two-run graph
    session = engine.session()
    session.append(prompt)
    request = session.submit("action", max_new_tokens=400, ignore_eos=True)
    while not (request.phase is not None and request.out):
        engine.step()

    def steps():
        with profile() as prof:
            for _ in range(32):
                engine.step()
        return prof

    for _ in range(3):
        events = {e.key: e for e in on_compute(steps).key_averages()}
        lookup = events["TorchDynamo Cache Lookup"]
        ms = lookup.cpu_time_total / lookup.count / 1000
        print(f"guard check: {ms:.3f} ms a step ({lookup.count} steps)", flush=True)


if __name__ == "__main__":
    main()
