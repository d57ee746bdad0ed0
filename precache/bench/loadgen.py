"""Load generation for the serving benchmark: N agent trajectories replayed against an
OpenAI-compatible endpoint with the ``openai`` client, requests arriving as a Poisson process.

Each trajectory follows a trace (:mod:`precache.bench.trace`): before turn i, ``prefill_len``
random tokens are appended (a tool observation), then ``agent`` generates ``decode_len`` tokens
(``ignore_eos``); the next request resends the whole trajectory, as a multi-agent framework does.
Arrivals are bounded: an arrival waits until some trajectory is idle (its previous turn answered),
so at most N requests are in flight.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import asdict, dataclass

import httpx
import openai

from precache.bench.trace import Trace, token_stream

#: the client's connection pool: idle keep-alive connections dropped after 2 s, well before the
#: server closes them (uvicorn's ``timeout_keep_alive``, 5 s, equal to httpx's default expiry; with
#: equal timeouts a request can go out on a connection the server is closing and fail as a
#: connection error, as one of 128 requests of a `bench serve` run did, its cause then unrecorded);
#: ``max_retries=0`` keeps every failure counted, and a failure's record names its cause
CLIENT_LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=2.0)


@dataclass(frozen=True)
class RequestRecord:
    """One request: times in seconds from sending it; token counts in tokens; ``error`` or None;
    ``replica``: which replica served it (the cluster's ``x-precache-replica`` header), or None."""

    trajectory: int
    turn: int
    agent: str
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: str | None = None
    replica: str | None = None


class _Trajectory:
    def __init__(self, index: int, trace: Trace, appended: list[list[int]]):
        self.index, self.trace, self.appended = index, trace, appended
        self.ids: list[int] = []
        self.turn = 0

    @property
    def done(self) -> bool:
        return self.turn >= len(self.trace.turns)


async def _one_request(client: openai.AsyncOpenAI, traj: _Trajectory) -> RequestRecord:
    turn = traj.trace.turns[traj.turn]
    traj.ids += traj.appended[traj.turn]
    t0 = time.perf_counter()
    ttft, out, usage, error, replica = None, [], None, None, None
    try:
        stream = await client.completions.create(
            model=turn.agent,
            prompt=traj.ids,
            max_tokens=turn.decode_len,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        replica = stream.response.headers.get("x-precache-replica")
        async for chunk in stream:
            ttft = ttft if ttft is not None or not chunk.choices else time.perf_counter() - t0
            if chunk.choices and getattr(chunk.choices[0], "token_ids", None):
                out = list(chunk.choices[0].token_ids)
            usage = chunk.usage or usage
    except openai.APIError as exc:
        cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
        error = f"{type(exc).__name__}: {exc}{cause}"
    latency = time.perf_counter() - t0
    record = RequestRecord(
        traj.index,
        traj.turn,
        turn.agent,
        ttft if ttft is not None else latency,
        latency,
        usage.prompt_tokens if usage else len(traj.ids),
        usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0,
        usage.completion_tokens if usage else 0,
        error,
        replica,
    )
    traj.ids += out
    traj.turn += 1
    return record


async def replay(
    base_url: str, trace: Trace, sessions: int, qps: float, vocab_size: int, special_ids=(), seed: int = 0
) -> tuple[list[RequestRecord], float]:
    """Replay ``trace`` on ``sessions`` trajectories at ``qps`` requests/s (Poisson arrivals);
    return the records and the wall time in seconds. Trajectory k draws its appended tokens with
    seed ``seed + k``, so trajectories never share a prefix by chance.

    Raises:
        ValueError: ``sessions`` < 1 or ``qps`` <= 0.
    """
    if sessions < 1 or qps <= 0:
        raise ValueError(f"need sessions >= 1 and qps > 0, got {sessions}, {qps}")
    trajs = [
        _Trajectory(k, trace, token_stream(trace, vocab_size, special_ids, seed + k)) for k in range(sessions)
    ]
    idle: asyncio.Queue[_Trajectory] = asyncio.Queue()
    for traj in trajs:
        idle.put_nowait(traj)
    rng, records = random.Random(seed), []
    client = openai.AsyncOpenAI(
        base_url=base_url,
        api_key="unused",
        max_retries=0,
        timeout=600,
        http_client=openai.DefaultAsyncHttpxClient(limits=CLIENT_LIMITS),
    )

    async def run(traj: _Trajectory) -> None:
        records.append(await _one_request(client, traj))
        if not traj.done:
            idle.put_nowait(traj)

    loop = asyncio.get_running_loop()
    start = next_at = loop.time()
    tasks = []
    for _ in range(sessions * len(trace.turns)):
        next_at += rng.expovariate(qps)
        await asyncio.sleep(max(0.0, next_at - loop.time()))
        tasks.append(asyncio.create_task(run(await idle.get())))
    await asyncio.gather(*tasks)
    wall = loop.time() - start
    await client.close()
    return records, wall


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def _replica_moves(records: list[RequestRecord]) -> int:
    """Turns served by another replica than their trajectory's previous turn (0 on one server)."""
    moves, last = 0, {}
    for r in sorted(records, key=lambda r: (r.trajectory, r.turn)):
        if r.error is None and r.replica is not None:
            moves += r.trajectory in last and last[r.trajectory] != r.replica
            last[r.trajectory] = r.replica
    return moves


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    """p50/p90 TTFT and latency (seconds), throughput (output tokens/s and requests/s over the
    wall time), cached-token ratio (cached / prompt tokens), ``prefill_tokens`` (prompt tokens not
    served from a cache, summed), ``replica_moves`` (:func:`_replica_moves`), error count;
    ``requests``: every record."""
    ok = [r for r in records if r.error is None]
    ttft, latency = [r.ttft_s for r in ok], [r.latency_s for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p90_s": _percentile(ttft, 90),
        "latency_p50_s": _percentile(latency, 50),
        "latency_p90_s": _percentile(latency, 90),
        "throughput_tok_s": sum(r.completion_tokens for r in ok) / wall_s if wall_s else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s else 0.0,
        "cached_ratio": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "prefill_tokens": prompt - sum(r.cached_tokens for r in ok),
        "replica_moves": _replica_moves(records),
        "errors": len(records) - len(ok),
        "wall_s": wall_s,
        "requests": [asdict(r) for r in records],
    }
