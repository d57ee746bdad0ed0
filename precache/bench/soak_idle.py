"""``bench soak --idle-conversations N``: many idle conversations against a bounded host swap space.

One engine in this process, with a small block pool and ``swap_space_bytes`` of host swap space,
opens ``N`` conversations one after the other (a random ``tokens``-token prompt, one turn by the
next agent in turn) and leaves them idle. The pool holds a few; the rest are swapped out to host
memory, and past the swap space the least recently used are dropped
(:mod:`precache.engine.swap_space`). The process RSS is sampled after every conversation: it must
grow by at most the swap space (plus the Python objects of the tokens), not by ``N`` caches. Then
the first ``returning`` conversations (dropped by then) take one more turn each, rebuilt from their
tokens, and their tokens are compared with the same conversation on an engine that never dropped
it (must be equal).
"""

from __future__ import annotations

import logging
import os
import random

import precache
from precache.bench.common import ordinary_ids
from precache.engine.swap_space import physical_memory_bytes

logger = logging.getLogger(__name__)

TURN_TOKENS = 4


def rss_bytes() -> int:
    """Resident set size of this process in bytes (``/proc/self/statm``; psutil elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def _history(session, agents: list[str], rng: random.Random, vocab: list[int], tokens: int, i: int):
    session.append([rng.choice(vocab) for _ in range(tokens)])
    return session.generate(agents[i % len(agents)], max_new_tokens=TURN_TOKENS, temperature=0.0).token_ids


def run_idle_phase(
    model,
    adapters: dict,
    method: str,
    conversations: int,
    tokens: int,
    kv_cache_bytes: int,
    swap_space_bytes: int,
    seed: int,
    returning: int = 3,
) -> dict:
    """Run the phase of the module docstring; returns its report (JSON-ready; bytes in MiB).

    Raises:
        ValueError: ``swap_space_bytes`` is not an integer >= 0.
    """
    vocab = ordinary_ids(model)
    agents = list(adapters)
    engine = precache.Engine(
        model,
        adapters=adapters,
        method=method,
        kv_cache_bytes=kv_cache_bytes,
        swap_space_bytes=swap_space_bytes,
    )
    engine.eos_token_ids = frozenset()  # every turn its full length
    mib = 2**20
    base = rss_bytes()
    samples: list[tuple[int, float, float]] = []  # (conversations open, RSS MiB, swap used MiB)
    sessions, first_turns, rngs = [], [], []
    for i in range(conversations):
        rngs.append(random.Random(seed * 7919 + i))
        sessions.append(engine.session())
        first_turns.append(_history(sessions[-1], agents, rngs[-1], vocab, tokens, i))
        samples.append((i + 1, round(rss_bytes() / mib, 1), round(engine.swap_usage()["used"] / mib, 1)))
    peak = max(s[1] for s in samples)
    usage_idle = engine.swap_usage()
    # conversations that come back (the least recently used: dropped first), against a fresh engine
    reference = precache.Engine(model, adapters=adapters, method=method, swap_space_bytes=swap_space_bytes)
    reference.eos_token_ids = frozenset()
    differ, came_back = 0, []
    for i in range(min(returning, conversations)):
        dropped = sessions[i].dropped
        ref = reference.session()
        ref_first = _history(ref, agents, random.Random(seed * 7919 + i), vocab, tokens, i)
        tail = [rngs[i].choice(vocab) for _ in range(8)]
        sessions[i].append(tail)
        ref.append(tail)
        agent = agents[(i + 1) % len(agents)]
        got = sessions[i].generate(agent, max_new_tokens=TURN_TOKENS, temperature=0.0).token_ids
        want = ref.generate(agent, max_new_tokens=TURN_TOKENS, temperature=0.0).token_ids
        differ += sum(a != b for a, b in zip([*first_turns[i], *got], [*ref_first, *want], strict=True))
        came_back.append({"conversation": i, "was_dropped": dropped})
        ref.close()
    usage = engine.swap_usage()
    one = usage["peak"] / max(usage["sessions"], 1) if usage["sessions"] else 0
    return {
        "conversations": conversations,
        "tokens_per_conversation": tokens + TURN_TOKENS,
        "kv_cache_mib": round(kv_cache_bytes / mib, 1),
        "swap_space_mib": round(swap_space_bytes / mib, 1),
        "physical_memory_mib": round(physical_memory_bytes() / mib),
        "swapped_conversation_mib": round(one / mib, 1),
        "rss_before_mib": round(base / mib, 1),
        "rss_peak_mib": peak,
        "rss_growth_mib": round(peak - base / mib, 1),
        "rss_samples": samples,
        "swap_usage_idle": usage_idle,
        "swap_usage": usage,
        "returned": came_back,
        "tokens_differing_after_rebuild": differ,
    }


def idle_table(idle: dict):
    """The idle phase's report (:func:`run_idle_phase`) as a rich ``Table``."""
    from rich.table import Table

    table = Table(title=f"idle phase: {idle['conversations']} idle conversations")
    table.add_column("measure")
    table.add_column("value", justify="right")
    usage = idle["swap_usage_idle"]
    for label, value in [
        ("tokens per conversation", idle["tokens_per_conversation"]),
        ("swap space / block pool MiB", f"{idle['swap_space_mib']:g} / {idle['kv_cache_mib']:g}"),
        ("host MiB of one swapped conversation", f"{idle['swapped_conversation_mib']:g}"),
        ("RSS MiB before / peak / growth", f"{idle['rss_before_mib']:.0f} / {idle['rss_peak_mib']:.0f} / "
         f"{idle['rss_growth_mib']:.0f}"),
        ("swapped out / held now / dropped", f"{usage['swap_outs']} / {usage['sessions']} / {usage['drops']}"),
        ("rebuilt tokens (returning conversations)", idle["swap_usage"]["rebuilt_tokens"]),
        ("tokens differing after rebuild (must be 0)", idle["tokens_differing_after_rebuild"]),
    ]:  # fmt: skip
        table.add_row(label, str(value))
    return table
