"""Issue 20's livelock case against a live server: ``precache serve --adapters qv --kv-cache-bytes
60000000`` (76 blocks of SmolLM2), then N concurrent ``/v1/completions`` requests, each a ~250-token
prompt (token ids) with ``max_tokens``, ``ignore_eos``, ``temperature 0`` and its own
``cache_salt``. Prints one JSON line per repeat: requests answered, 5xx, wall seconds until the
last answer (or the deadline), generated tokens per second.

Usage: python benchmarks/livelock.py [--requests 16] [--repeats 3] [--deadline 150]
(run with ``PYTHONPATH=<other checkout>`` to measure another version of precache)
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "precache.cli", "serve", "--adapters", "qv"]
    cmd += ["--kv-cache-bytes", "60000000", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError("the server did not come up in 300 s")


def _ask(url: str, k: int, max_tokens: int, deadline: float) -> tuple[int, int, float]:
    """``(status, generated tokens, seconds)``; status 0: no answer before the deadline."""
    rng = random.Random(k)
    body = {
        "model": ("plan", "action", "reflect")[k % 3],
        "prompt": [rng.randrange(100, 40000) for _ in range(250)],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_salt": f"client-{k}",
    }
    t0 = time.perf_counter()
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=max(1.0, deadline - time.monotonic()))
    except httpx.TimeoutException:
        return 0, 0, time.perf_counter() - t0
    tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
    return r.status_code, tokens, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=150)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--deadline", type=float, default=150.0, help="seconds a repeat may take")
    args = p.parse_args()
    port = _free_port()
    proc = _serve(port)
    try:
        for repeat in range(args.repeats):
            deadline = time.monotonic() + args.deadline
            t0 = time.perf_counter()
            url = f"http://127.0.0.1:{port}"
            keys = [1000 * repeat + k for k in range(args.requests)]
            with ThreadPoolExecutor(args.requests) as pool:
                out = list(
                    pool.map(
                        _ask, [url] * len(keys), keys, [args.max_tokens] * len(keys), [deadline] * len(keys)
                    )
                )
            wall = time.perf_counter() - t0
            answered = sum(s == 200 for s, _, _ in out)
            tokens = sum(t for _, t, _ in out)
            print(
                json.dumps(
                    {
                        "requests": args.requests,
                        "answered": answered,
                        "5xx": sum(s >= 500 for s, _, _ in out),
                        "unanswered_at_deadline": sum(s == 0 for s, _, _ in out),
                        "wall_s": round(wall, 1),
                        "tokens_per_s": round(tokens / wall, 2),
                    }
                ),
                flush=True,
            )
            if answered < args.requests:  # a livelocked server stays busy: the next repeat would wait on it
                break
    finally:
        proc.kill()


if __name__ == "__main__":
    main()
