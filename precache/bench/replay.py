"""Replay a trace on one engine session and measure each turn.

Each replayed turn is an engine :class:`~precache.engine.outputs.Turn`: TTFT runs from the start of the turn's
prefill to the first sampled token, decode from there to the last token. A replay's total latency
is the sum of its turn latencies plus ReBaseShared LP's post-turn neutral pass, which holds the
single stream between turns without delaying the next turn's TTFT; throughput is the trajectory
length divided by that total.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

from precache.bench.trace import Trace, check_fits
from precache.engine.outputs import Turn


@dataclass
class Replay:
    """All turns of one replay of a trace under one method (or baseline)."""

    method: str
    trajectory_tokens: int
    turns: list[Turn] = field(default_factory=list)
    peak_kv_bytes: int = 0

    def add_baseline_turn(
        self,
        agent: str,
        token_ids: list[int],
        ttft_s: float,
        decode_s: float,
        prefill_tokens: int,
        kv_bytes: int,
    ) -> None:
        """Record one greedy turn of a baseline (HF + PEFT, llama.cpp): exactly the trace turn's
        ``decode_len`` tokens, so its stop reason is ``"length"``. ``ttft_s`` / ``decode_s`` in
        seconds; ``kv_bytes``: the KV cache the baseline holds after the turn (bytes), which
        raises ``peak_kv_bytes`` when larger."""
        self.turns.append(
            Turn(
                agent=agent,
                token_ids=token_ids,
                stop_reason="length",
                ttft_s=ttft_s,
                decode_s=decode_s,
                prefill_tokens=prefill_tokens,
                kv_bytes=kv_bytes,
            )
        )
        self.peak_kv_bytes = max(self.peak_kv_bytes, kv_bytes)

    def metrics(self) -> dict[str, float]:
        """Per-replay totals.

        ``ttft_s``: sum of TTFTs; ``latency_s``: sum of turn latencies plus LP's neutral passes;
        ``throughput_tok_s``: trajectory tokens / ``latency_s``; ``decode_tok_s``: decode steps
        (each turn's tokens after the first) / decode time; ``peak_kv_bytes``; ``prefill_tokens``:
        tokens run through prefill forwards (ReBaseShared DB's neutral row included);
        ``neutral_tokens``: LP's post-turn neutral pass.
        """
        ttft = sum(t.ttft_s for t in self.turns)
        latency = sum(t.ttft_s + t.decode_s + t.neutral_s for t in self.turns)
        decode_s = sum(t.decode_s for t in self.turns)
        steps = sum(t.new_tokens - 1 for t in self.turns)
        return {
            "ttft_s": ttft,
            "latency_s": latency,
            "throughput_tok_s": self.trajectory_tokens / latency if latency > 0 else 0.0,
            "decode_tok_s": steps / decode_s if decode_s > 0 else 0.0,
            "peak_kv_bytes": float(self.peak_kv_bytes),
            "prefill_tokens": float(sum(t.prefill_tokens for t in self.turns)),
            "neutral_tokens": float(sum(t.neutral_tokens for t in self.turns)),
        }


def replay_engine(engine, trace: Trace, stream: list[list[int]]) -> Replay:
    """Replay ``trace`` on a fresh session of ``engine``: append each turn's ids from ``stream``,
    then generate exactly ``decode_len`` tokens greedily (``ignore_eos``).

    Raises:
        TraceError: the trace passes the model's context length.
        UnknownAdapterError: a turn's agent is not loaded.
    """
    check_fits(trace, engine.max_context)
    gc.collect()
    session = engine.session()
    turns = []
    for turn, ids in zip(trace.turns, stream, strict=True):
        session.append(ids)
        turns.append(
            session.generate(
                agent=turn.agent, max_new_tokens=turn.decode_len, temperature=0.0, ignore_eos=True
            )
        )
    return Replay(engine.method_name, trace.total_tokens, turns, session.cache_bytes()["peak"])
