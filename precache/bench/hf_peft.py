"""The HF transformers + PEFT baseline: NonShared at its honest best, on the reference stack.

One PEFT model holds every role adapter (``load_adapter``; ``set_adapter`` switches between them)
and each agent keeps its own ``DynamicCache`` over the trajectory, prefilling only what it has
not processed yet (the other agents' tokens since its last turn). Decoding is a plain greedy
loop. It measures TTFT and decode time exactly like the engine's session, so precache's
NonShared is measured against it, and it generates the same greedy tokens (an oracle in tests).
"""

from __future__ import annotations

import copy
import gc
import os
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from precache.bench.replay import Replay
from precache.bench.trace import Trace, TraceError

METHOD_NAME = "hf-peft"


def _cache_bytes(cache) -> int:
    """Bytes held by the key / value tensors of a ``DynamicCache``."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


class HFPeftAgents:
    """Agents as PEFT adapters on an HF causal LM, one ``DynamicCache`` per agent.

    ``hf_model``: an HF ``*ForCausalLM``, copied so the caller's model is never wrapped, unless
    ``take=True`` (a model built for this baseline alone: PEFT wraps it in place, saving the copy);
    ``adapters``: PEFT adapter folders by agent name.

    Raises:
        TraceError: no adapter is given. PEFT's own errors pass through for a folder that does
        not fit the model.
    """

    def __init__(self, hf_model, adapters: dict[str, str | os.PathLike], take: bool = False):
        from peft import PeftModel  # heavy, and only this baseline needs it

        if not adapters:
            raise TraceError("the hf-peft baseline needs at least one adapter")
        names = list(adapters)
        base = (hf_model if take else copy.deepcopy(hf_model)).eval()
        self.model = PeftModel.from_pretrained(base, str(Path(adapters[names[0]])), adapter_name=names[0])
        for name in names[1:]:
            self.model.load_adapter(str(Path(adapters[name])), adapter_name=name)
        self.model.eval()
        self.agents = names
        self.config = hf_model.config
        self.max_context = int(getattr(hf_model.config, "max_position_embeddings", 1 << 30))

    @torch.inference_mode()
    def _step(self, ids: list[int], cache) -> torch.Tensor:
        """Forward ``ids`` after what ``cache`` holds; return the last position's logits ``[vocab]``."""
        ids_t = torch.tensor([ids], device=self.model.device)
        out = self.model(ids_t, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def turn(
        self, trajectory: list[int], agent: str, cache, max_new_tokens: int
    ) -> tuple[list[int], float, float]:
        """One greedy turn of ``agent`` over ``trajectory`` (extended in place with the new tokens).

        Returns ``(token ids, TTFT s, decode s)``. The agent prefills ``trajectory[cache length:]``.
        """
        self.model.set_adapter(agent)
        t0 = time.perf_counter()
        logits = self._step(trajectory[cache.get_seq_length() :], cache)
        out = [int(logits.argmax())]
        ttft = time.perf_counter() - t0
        while len(out) < max_new_tokens:
            logits = self._step(out[-1:], cache)
            out.append(int(logits.argmax()))
        trajectory.extend(out)
        return out, ttft, time.perf_counter() - t0 - ttft

    def replay(self, trace: Trace, stream: list[list[int]]) -> Replay:
        """Replay ``trace`` like :func:`precache.bench.replay.replay_engine`.

        Raises:
            TraceError: an agent has no adapter here, or the trace passes the context length.
        """
        unknown = [a for a in trace.agents if a not in self.agents]
        if unknown:
            raise TraceError(
                f"hf-peft: no adapter for agent(s) {', '.join(unknown)} (loaded: {', '.join(self.agents)})"
            )
        if trace.total_tokens > self.max_context:
            raise TraceError(
                f"trace {trace.name} needs {trace.total_tokens:,} tokens, context is {self.max_context:,}"
            )
        gc.collect()
        caches = {a: DynamicCache(config=self.config) for a in trace.agents}
        trajectory: list[int] = []
        replay = Replay(METHOD_NAME, trace.total_tokens)
        for turn, ids in zip(trace.turns, stream, strict=True):
            trajectory.extend(ids)
            prefill = len(trajectory) - caches[turn.agent].get_seq_length()
            tokens, ttft, decode = self.turn(trajectory, turn.agent, caches[turn.agent], turn.decode_len)
            kv = sum(_cache_bytes(c) for c in caches.values())
            replay.add_baseline_turn(turn.agent, tokens, ttft, decode, prefill, kv)
        return replay
