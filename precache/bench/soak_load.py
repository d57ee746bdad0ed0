"""The clients of ``precache bench soak`` (:mod:`precache.bench.soak`): tenants sending completions
in a loop, a stalled reader and slowloris sockets, each run on its own thread until a deadline.

Every client counts what it saw (:attr:`SoakLoad.outcomes`: ``"200 whole"``, ``"200 stream"``,
``"stream hung up by the client"``, ``"<status> <code>"``, ``"stream error <code>"``, ``"client
error <exception>"``) and keeps each completed request (:attr:`SoakLoad.completed`) so that its
tokens can be checked against the same request run alone.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import httpx

#: prompt tokens and completion tokens of every tenant request
PROMPT_LEN, MAX_TOKENS = 24, 8
#: tokens of the stalled reader's stream (4 choices with 20 log-probabilities each: far more than
#: a socket's buffers hold)
STALL_TOKENS = 120


def parse_sse(lines: list[str]) -> tuple[list[int] | None, tuple[int, str] | None]:
    """``(token ids of a finished choice, (status, code) of an error event)`` of a stream's lines
    (each None when the stream has none)."""
    tokens, error = None, None
    for line in lines:
        if not line.startswith("data: {"):
            continue
        data = json.loads(line.removeprefix("data: "))
        if "error" in data:
            error = (int(data["error"].get("status", 0) or 0), data["error"].get("code") or "none")
        for choice in data.get("choices", []):
            if choice.get("finish_reason") is not None:
                tokens = choice.get("token_ids")
    return tokens, error


class SoakLoad:
    """The soak's clients against one server ``url`` (``.../v1``) until ``deadline``
    (``time.monotonic()`` seconds); every method is a thread's target.

    Args:
        url: the server's OpenAI base URL.
        agents: adapter names a tenant picks from (the request's ``model``).
        vocab: token ids a random prompt is drawn from (no special tokens).
        tenants: how many tenants send (each its own ``cache_salt``).
        seed: seeds each tenant's generator and names the salts.
        deadline: when every client stops, in ``time.monotonic()`` seconds.
    """

    def __init__(
        self, url: str, agents: list[str], vocab: list[int], tenants: int, seed: int, deadline: float
    ):
        self.url, self.agents, self.vocab, self.deadline = url, agents, vocab, deadline
        self.tenants, self.seed = tenants, seed
        self.lock = threading.Lock()
        self.completed: list[dict] = []  # {agent, prompt, tokens, tenant}
        self.outcomes: dict[str, int] = {}
        self.stalls = self.slowloris_closed = 0

    def _count(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def tenant(self, index: int) -> None:
        """Tenant ``index``: a fresh random prompt for a random agent, greedy, streamed or not, again
        and again; a fifth of its streams hang up after two chunks."""
        rng = random.Random(self.seed * 1000 + index)
        salt = f"soak-tenant-{self.seed}-{index}"
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < self.deadline:
                prompt = [rng.choice(self.vocab) for _ in range(PROMPT_LEN)]
                agent, stream = rng.choice(self.agents), rng.random() < 0.5
                hang_up = stream and rng.random() < 0.2
                body = {
                    "model": agent, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "cache_salt": salt, "return_token_ids": True, "stream": stream,
                }  # fmt: skip
                try:
                    tokens = self._send(client, body, hang_up)
                except httpx.HTTPError as exc:
                    self._count(f"client error {type(exc).__name__}")
                    continue
                if tokens is not None:
                    with self.lock:
                        self.completed.append(
                            {"agent": agent, "prompt": prompt, "tokens": tokens, "tenant": index}
                        )

    def _send(self, client: httpx.Client, body: dict, hang_up: bool) -> list[int] | None:
        if not body["stream"]:
            r = client.post(self.url + "/completions", json=body)
            if r.status_code != 200:
                self._count(f"{r.status_code} {r.json().get('error', {}).get('code')}")
                return None
            self._count("200 whole")
            return r.json()["choices"][0]["token_ids"]
        lines = []
        with client.stream("POST", self.url + "/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                self._count(f"{r.status_code} {r.json().get('error', {}).get('code')}")
                return None
            for line in r.iter_lines():
                lines.append(line)
                if hang_up and sum(1 for x in lines if x.startswith("data: {")) >= 2:
                    self._count("stream hung up by the client")
                    return None
        tokens, error = parse_sse(lines)
        if error is not None:
            self._count(f"stream error {error[1]}")
            return None
        self._count("200 stream")
        return tokens

    def stalled_reader(self, host: str, port: int, hold_s: float) -> None:
        """Open a long stream over a socket with a tiny receive buffer and never read it, holding it
        ``hold_s`` seconds, again and again (the server must hold it, then cancel it)."""
        body = json.dumps(
            {"model": self.agents[0], "prompt": self.vocab[:PROMPT_LEN], "max_tokens": STALL_TOKENS,
             "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 20, "n": 4,
             "cache_salt": f"soak-stalled-{self.seed}"}
        ).encode()  # fmt: skip
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        while time.monotonic() + hold_s < self.deadline:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            sock.connect((host, port))
            sock.sendall(head + body)
            time.sleep(hold_s)  # never read
            sock.close()
            with self.lock:
                self.stalls += 1

    def slowloris(self, host: str, port: int, sockets: int) -> None:
        """Keep ``sockets`` sockets open, each sending a request's headers a byte at a time; count
        those the server closes and open new ones in their place."""
        request = f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-length: 10\r\n".encode()
        open_: list[list] = []  # [socket, bytes sent]
        while time.monotonic() < self.deadline:
            while len(open_) < sockets:
                s = socket.create_connection((host, port), timeout=5)
                s.setblocking(False)
                open_.append([s, 0])
            for entry in list(open_):
                s, sent = entry
                try:
                    if sent < len(request):
                        s.send(request[sent : sent + 1])
                        entry[1] += 1
                    if s.recv(4096) == b"":
                        raise ConnectionError
                except BlockingIOError:
                    continue
                except OSError:
                    s.close()
                    open_.remove(entry)
                    with self.lock:
                        self.slowloris_closed += 1
            time.sleep(0.5)
        for s, _ in open_:
            s.close()
