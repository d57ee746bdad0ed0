"""llama.cpp as a baseline of ``bench trace``: llama-server with every agent's LoRA loaded and the
turn's adapter applied per request (its ``lora`` field), the model and adapters converted to GGUF
with llama.cpp's own converters.

Five configurations (:data:`CONFIGS`), each a runner of :func:`precache.bench.suite.run_suite`:

- ``llama-cpp-f32`` / ``llama-cpp-q8_0``: one slot per agent (``id_slot``), llama.cpp's best for
  a multi-adapter trajectory: each agent's slot keeps its own cache across its turns and prefills
  only what the other agents appended since (NonShared's token count);
- ``llama-cpp-q4_0``: the same with 4-bit weights (``llama-quantize`` from the f32 file);
- ``llama-cpp-f32-1slot`` / ``llama-cpp-q8_0-1slot``: one slot for every agent; llama.cpp clears a
  slot's cache when the next request's adapters differ, so every adapter switch recomputes the
  trajectory.

The RAM prompt cache is off (``--cache-ram 0``): it restores a prompt's cache computed under one
adapter for a request under another (``benchmarks/llama_cpp_reuse.py`` shows the wrong tokens that
gives), and it would also carry a replay's cache into the next repeat. Each replay starts by
erasing every slot. Times are llama-server's own (``timings``: ``prompt_ms`` is the TTFT,
``predicted_ms`` the decode), so HTTP costs llama.cpp nothing here. Its KV cache is llama.cpp's
default f16; ``kv_bytes`` counts the tokens its slots hold at 2 bytes a value. On a CPU with AMX
the servers run with ``--no-repack``: llama.cpp's AMX-repacked quantized weights crash llama-server
as it loads the LoRA adapters.

Where llama.cpp is built and how the GGUF files are made: :mod:`precache.bench.llama_cpp_gguf`
(``make llama-cpp`` builds it; without it the baseline is refused with that command); the server
process: :mod:`precache.bench.llama_server`.
"""

from __future__ import annotations

import contextlib

from precache.bench.llama_cpp_gguf import find_llama_cpp, gguf_adapter, gguf_model
from precache.bench.llama_server import LlamaServer
from precache.bench.replay import Replay
from precache.bench.trace import Trace, TraceError
from precache.errors import PrecacheError

BASELINE = "llama-cpp"
#: configuration name -> (GGUF weight type, one slot per agent)
CONFIGS = {
    "llama-cpp-f32": ("f32", True),
    "llama-cpp-f32-1slot": ("f32", False),
    "llama-cpp-q8_0": ("q8_0", True),
    "llama-cpp-q8_0-1slot": ("q8_0", False),
    "llama-cpp-q4_0": ("q4_0", True),
}
#: bytes of one K or V value in llama.cpp's default cache type (f16)
KV_VALUE_BYTES = 2


class LlamaCppAgents:
    """Agents as llama.cpp LoRAs on one llama-server: each turn is one ``/completion`` of the whole
    trajectory (token ids) with the agent's adapter at scale 1 and the others at 0, greedy,
    exactly ``decode_len`` tokens (``ignore_eos``), in the agent's slot (``per_agent_slots``) or
    slot 0.

    ``kv_value_bytes_per_token``: bytes of one token's K and V over all layers at one byte a value
    (``2 * layers * kv_heads * head_dim``); multiplied by :data:`KV_VALUE_BYTES`.
    """

    def __init__(
        self,
        server: LlamaServer,
        name: str,
        agents: list[str],
        per_agent_slots: bool,
        kv_values_per_token: int,
    ):
        self.server, self.name, self.agents = server, name, list(agents)
        self.per_agent_slots = per_agent_slots
        self.kv_token_bytes = kv_values_per_token * KV_VALUE_BYTES

    def _slot(self, agent: str) -> int:
        return self.agents.index(agent) if self.per_agent_slots else 0

    def replay(self, trace: Trace, stream: list[list[int]]) -> Replay:
        """Replay ``trace`` like :func:`precache.bench.replay.replay_engine`.

        Raises:
            TraceError: an agent has no adapter here.
        """
        unknown = [a for a in trace.agents if a not in self.agents]
        if unknown:
            raise TraceError(f"{self.name}: no adapter for agent(s) {', '.join(unknown)}")
        self.server.erase_slots()
        trajectory: list[int] = []
        held: dict[int, int] = {}
        replay = Replay(self.name, trace.total_tokens)
        for turn, ids in zip(trace.turns, stream, strict=True):
            trajectory.extend(ids)
            agent_id = self.agents.index(turn.agent)
            slot = self._slot(turn.agent)
            answer = self.server.complete(trajectory, turn.decode_len, slot, agent_id, len(self.agents))
            tokens = [int(t) for t in answer["tokens"]]
            if len(tokens) != turn.decode_len:
                raise PrecacheError(f"{self.name}: {len(tokens)} tokens for a {turn.decode_len}-token turn")
            timings = answer["timings"]
            trajectory.extend(tokens)
            held[slot] = int(answer.get("tokens_cached", len(trajectory)))
            replay.add_baseline_turn(
                turn.agent,
                tokens,
                ttft_s=timings["prompt_ms"] / 1000,
                decode_s=timings["predicted_ms"] / 1000,
                prefill_tokens=int(timings["prompt_n"]),
                kv_bytes=sum(held.values()) * self.kv_token_bytes,
            )
        return replay


def parse_baselines(spec: str) -> list[str]:
    """``hf-peft,llama-cpp`` -> runner names: ``llama-cpp`` is every configuration of
    :data:`CONFIGS`; a configuration may also be named alone.

    Raises:
        PrecacheError: an unknown name (the known ones listed).
    """
    known = ("hf-peft", BASELINE, *CONFIGS)
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part not in known:
            raise PrecacheError(f"--baselines: unknown baseline '{part[:40]}' (known: {', '.join(known)})")
        for name in CONFIGS if part == BASELINE else (part,):
            if name not in names:
                names.append(name)
    return names


@contextlib.contextmanager
def llama_cpp_runners(
    configs: list[str], checkpoint, adapters: dict[str, str], model_config, trace: Trace, threads: int
):
    """Start one llama-server per configuration in ``configs`` and yield ``{name: runner}``; every
    server stops on exit.

    ``model_config``: the engine's :class:`~precache.models.config.ModelConfig` (for KV bytes).

    Raises:
        LlamaCppMissingError: llama.cpp is not built.
        PrecacheError: a conversion or a server start failed.
    """
    if not configs:  # nothing asked of llama.cpp: it need not be built
        yield {}
        return
    tree = find_llama_cpp()
    agents = list(adapters)
    loras = [gguf_adapter(tree, adapters[a], checkpoint) for a in agents]
    slot_context = -(-(trace.total_tokens + 64) // 256) * 256
    kv_values = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim
    with contextlib.ExitStack() as stack:
        runners = {}
        for name in configs:
            weight_type, per_agent = CONFIGS[name]
            server = stack.enter_context(
                LlamaServer(
                    tree,
                    gguf_model(tree, checkpoint, weight_type),
                    loras,
                    len(agents) if per_agent else 1,
                    slot_context,
                    threads,
                )
            )
            runners[name] = LlamaCppAgents(server, name, agents, per_agent, kv_values).replay
        yield runners
