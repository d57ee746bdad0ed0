"""Replay a trace on one engine session and measure each turn.

Timing follows :class:`precache.engine.session.Turn`: TTFT runs from the start of the turn's
prefill to the first sampled token, decode from there to the last token. A replay's total latency
is the sum of its turn latencies plus ReBaseShared LP's post-turn neutral pass, which holds the
single stream between turns without delaying the next turn's TTFT; throughput is the trajectory
length divided by that total.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

from precache.bench.trace import Trace, check_fits


@dataclass
class TurnRecord:
    """One replayed turn. Times in seconds, sizes in bytes; ``kv_bytes`` is the total KV-cache
    size once the turn is over; ``tokens`` are the generated ids."""

    agent: str
    ttft_s: float
    decode_s: float
    decode_tokens: int
    prefill_tokens: int
    kv_bytes: int
    neutral_tokens: int = 0
    neutral_s: float = 0.0
    tokens: list[int] = field(default_factory=list, repr=False)


@dataclass
class Replay:
    """All turns of one replay of a trace under one method (or baseline)."""

    method: str
    trajectory_tokens: int
    turns: list[TurnRecord]
    peak_kv_bytes: int

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
        steps = sum(t.decode_tokens - 1 for t in self.turns)
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
    then generate exactly ``decode_len`` tokens greedily (EOS is switched off on the engine).

    Raises:
        TraceError: the trace passes the model's context length.
        UnknownAdapterError: a turn's agent is not loaded.
    """
    check_fits(trace, engine.max_context)
    engine.eos_token_ids = frozenset()
    gc.collect()
    session = engine.session()
    records = []
    for turn, ids in zip(trace.turns, stream, strict=True):
        session.append(ids)
        out = session.generate(agent=turn.agent, max_new_tokens=turn.decode_len, temperature=0.0)
        records.append(
            TurnRecord(
                turn.agent,
                out.ttft_s,
                out.decode_s,
                len(out.token_ids),
                out.prefill_tokens,
                session.cache_bytes()["total"],
                out.neutral_tokens,
                out.neutral_s,
                list(out.token_ids),
            )
        )
    return Replay(engine.method_name, trace.total_tokens, records, session.cache_bytes()["peak"])
