"""Does llama.cpp reuse a prompt's cache computed under one adapter for a request under another?

A four-turn trajectory (plan reads 300 tokens, then action, plan, action, each after 8 new tokens)
is replayed on llama-server with each agent's LoRA applied per request, in five settings: one
slot, two slots pinned per agent, two slots chosen by llama.cpp (``id_slot: -1``), each with its
RAM prompt cache off (``--cache-ram 0``) and on (its default, 8192 MiB). Every turn's greedy
tokens are compared with precache's NonShared (the definition: each agent reads the trajectory
under its own adapter), and each turn's reused tokens (``cache_n``) are printed: reuse across
adapters with tokens equal to NonShared's is impossible, so reuse shows up in ``cache_n`` with
wrong tokens, or not at all.

    python benchmarks/llama_cpp_reuse.py        # needs `make llama-cpp`
"""

from __future__ import annotations

import precache
from precache.bench.common import special_ids
from precache.bench.llama_cpp_gguf import find_llama_cpp, gguf_adapter, gguf_model
from precache.bench.llama_server import LlamaServer
from precache.bench.trace import parse_trace, token_stream
from precache.resources import adapter_set

TRACE = "agent,prefill_len,decode_len\nplan,300,8\naction,8,16\nplan,8,16\naction,8,16\n"
#: (slots, slot choice, RAM cache MiB)
SETTINGS = ((1, "pinned", 0), (1, "pinned", 8192), (2, "pinned", 8192), (2, "auto", 0), (2, "auto", 8192))


def main() -> None:
    trace = parse_trace(TRACE)
    agents = ["plan", "action"]
    model = precache.load_model(None)
    adapters = adapter_set("qv", agents)
    stream = token_stream(trace, model.config.vocab_size, special_ids(model), seed=1)
    session = precache.Engine(model, adapters=adapters, method="nonshared").session()
    reference = []
    for turn, ids in zip(trace.turns, stream, strict=True):
        session.append(ids)
        reference.append(
            session.generate(
                agent=turn.agent, max_new_tokens=turn.decode_len, temperature=0.0, ignore_eos=True
            )
        )

    tree = find_llama_cpp()
    loras = [gguf_adapter(tree, adapters[a], model.path) for a in agents]
    print("| setting | " + " | ".join(f"turn {i + 1} ({t.agent})" for i, t in enumerate(trace.turns)) + " |")
    print("|---" * (len(trace.turns) + 1) + "|")
    cells = [f"{t.cached_tokens} reused, {t.new_tokens}/{t.new_tokens}" for t in reference]
    print("| precache NonShared (prefix caching on) | " + " | ".join(cells) + " |")
    for slots, choice, ram in SETTINGS:
        with LlamaServer(tree, gguf_model(tree, model.path, "f32"), loras, slots, 2048, 2, ram) as server:
            trajectory, cells = [], []
            for turn, ids, ref in zip(trace.turns, stream, reference, strict=True):
                trajectory += ids
                agent = agents.index(turn.agent)
                slot = -1 if choice == "auto" else (agent if slots > 1 else 0)
                answer = server.complete(trajectory, turn.decode_len, slot, agent, len(agents))
                trajectory += answer["tokens"]
                same = sum(x == y for x, y in zip(answer["tokens"], ref.token_ids, strict=True))
                cells.append(f"{answer['timings'].get('cache_n', 0)} reused, {same}/{turn.decode_len}")
        print(f"| llama.cpp f32, {slots} slot(s) {choice}, --cache-ram {ram} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
