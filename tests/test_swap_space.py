"""The host swap space (vLLM's ``swap_space``): swapped-out caches stay within a byte budget, the
least recently used idle session beyond it is dropped, and its next turn rebuilds the caches from
its tokens and gives the greedy tokens of a run that never dropped them."""

from __future__ import annotations

import pytest
import torch

from precache.server.metrics import ServerMetrics
from tests.tiny import make_engine

PROMPT, TURN = 40, 4


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _history(session, seed: int) -> list[list[int]]:
    """Two turns by two agents (so a PreLRShared base has two authors)."""
    session.append(_ids(seed, PROMPT))
    first = session.generate("plan", max_new_tokens=TURN).token_ids
    session.append(_ids(seed + 100, 6))
    return [first, session.generate("action", max_new_tokens=TURN).token_ids]


def _come_back(session, seed: int) -> list[list[int]]:
    session.append(_ids(seed + 200, 5))
    first = session.generate("reflect", max_new_tokens=6).token_ids
    return [first, session.generate("plan", max_new_tokens=TURN).token_ids]


def _swap_bytes(engine, session) -> int:
    """Host bytes ``session``'s caches take when swapped out (its distinct blocks)."""
    blocks = {b for s in session.state.paged_stores() for b in s.blocks}
    return len(blocks) * engine.pool.block_bytes


@pytest.mark.parametrize("method", ["nonshared", "prelrshared", "fullshared"])
def test_a_budget_of_two_swapped_sessions_drops_the_least_recently_used_third(tiny, method):
    model, dirs, _ = tiny
    probe = make_engine(model, dirs, method, kv_cache_bytes=1 << 24)
    s = probe.session()
    _history(s, 0)
    per_session = _swap_bytes(probe, s)  # every session below holds as many blocks
    blocks = per_session // probe.pool.block_bytes
    # the pool holds one session and the next one's turns: each new session swaps the last one out
    engine = make_engine(
        model,
        dirs,
        method,
        kv_cache_bytes=(blocks + blocks // 2 + 2) * probe.pool.block_bytes,
        swap_space_bytes=2 * per_session,
        prefix_caching=False,
    )
    sessions, history = [], []
    for i in range(4):
        sessions.append(engine.session())
        history.append(_history(sessions[-1], i))
        assert engine.swap_usage()["used"] <= 2 * per_session
    usage = engine.swap_usage()
    assert [s.swapped is not None for s in sessions] == [False, True, True, False]
    assert sessions[0].dropped and not any(s.dropped for s in sessions[1:])
    assert usage["swap_outs"] == 3 and usage["drops"] == 1 and usage["sessions"] == 2
    assert usage["used"] == 2 * per_session and usage["peak"] <= 2 * per_session
    cached = len(sessions[0].authors)
    assert cached == PROMPT + 6 + 2 * TURN - 1  # the last generated token has no entry yet

    back = _come_back(sessions[0], 0)  # rebuilt from its tokens, by their authors
    assert not sessions[0].dropped
    sessions[0].check()
    reference = make_engine(model, dirs, method, kv_cache_bytes=1 << 24).session()
    assert _history(reference, 0) == history[0]
    assert back == _come_back(reference, 0)
    usage = engine.swap_usage()
    assert usage["rebuilt_tokens"] == cached and usage["peak"] <= 2 * per_session
    assert back[0]  # and the swapped-in ones come back bit for bit, as before
    assert _come_back(sessions[1], 1) == _come_back(_replayed(model, dirs, method, 1), 1)


def _replayed(model, dirs, method, seed):
    s = make_engine(model, dirs, method, kv_cache_bytes=1 << 24).session()
    _history(s, seed)
    return s


def test_a_zero_budget_drops_every_idle_swap_out_and_a_fork_of_a_dropped_session_rebuilds(tiny):
    model, dirs, _ = tiny
    probe = make_engine(model, dirs, "prelrshared", kv_cache_bytes=1 << 24)
    s = probe.session()
    _history(s, 5)
    blocks = _swap_bytes(probe, s) // probe.pool.block_bytes
    engine = make_engine(
        model,
        dirs,
        "prelrshared",
        kv_cache_bytes=(blocks + blocks // 2 + 2) * probe.pool.block_bytes,
        swap_space_bytes=0,
        prefix_caching=False,
    )
    a, b = engine.session(), engine.session()
    _history(a, 5)
    _history(b, 6)
    assert a.dropped and a.swapped is None and engine.swap_usage()["peak"] == 0
    fork = a.fork(len(a) - 3)  # no caches to share: the fork rebuilds its own
    assert fork.dropped and fork.authors == a.authors[: len(a) - 3]
    b.close()
    reference = _replayed(model, dirs, "prelrshared", 5)
    assert _come_back(a, 5) == _come_back(reference, 5)


@pytest.mark.parametrize("value", [-1, 2.5, "1e9", True])
def test_a_bad_swap_space_is_refused_by_name(tiny, value):
    model, dirs, _ = tiny
    with pytest.raises(ValueError, match="swap_space_bytes"):
        make_engine(model, dirs, "prelrshared", swap_space_bytes=value)


def test_the_default_swap_space_is_a_share_of_physical_memory(tiny):
    from precache.engine.swap_space import HOST_SWAP_SHARE, physical_memory_bytes

    model, dirs, _ = tiny
    capacity = make_engine(model, dirs, "prelrshared").swap_usage()["capacity"]
    assert capacity == int(physical_memory_bytes() * HOST_SWAP_SHARE) > 0


def test_metrics_count_drops_and_rebuilt_tokens():
    metrics = ServerMetrics()
    usage = {"capacity": 1000, "used": 400, "drops": 2, "rebuilt_tokens": 90}
    metrics.swap_usage(usage)
    metrics.swap_usage({**usage, "used": 0, "drops": 3, "rebuilt_tokens": 130})
    text = metrics.render()[0].decode()
    assert "precache_swap_drops_total 3.0" in text
    assert "precache_swap_rebuilt_tokens_total 130.0" in text
    assert 'precache_swap_space_bytes{state="capacity"} 1000.0' in text
    assert 'precache_swap_space_bytes{state="used"} 0.0' in text


def test_serve_takes_swap_space_in_gib_and_refuses_a_bad_one_by_name(capsys):
    from precache.cli import main
    from precache.server.args import swap_space_gib

    assert swap_space_gib("0.5") == 2**29 and swap_space_gib("0") == 0
    for bad in ("-1", "lots", "inf"):
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--swap-space", bad])
        assert exc.value.code == 2 and "--swap-space" in capsys.readouterr().err
