"""A full block pool: a turn that can never fit is refused before any cache is touched; rows that do
not fit now wait for a later step instead of failing the whole batch; the pool's budget holds."""

from __future__ import annotations

import pytest
import torch

from precache.errors import CacheCapacityError, OutOfBlocksError
from tests.tiny import make_engine


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _block_bytes(model, dirs) -> int:
    return make_engine(model, dirs, "prelrshared", kv_cache_bytes=1 << 24).pool.block_bytes


def test_a_turn_that_can_never_fit_is_refused_up_front(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared", kv_cache_bytes=2 * _block_bytes(model, dirs))
    s = engine.session()
    s.append(_ids(1, 40))
    with pytest.raises(CacheCapacityError, match=r"needs 3 KV-cache blocks .* holds 2 .*kv_cache_bytes"):
        s.generate("plan", max_new_tokens=4)
    assert engine.cache_usage()["allocated"] == 0 and len(s) == 40
    # ReBaseShared also holds the turn's own full K/V: 3 trajectory blocks + 1 turn block do not fit 3
    rebase = make_engine(model, dirs, "rebaseshared-lp", kv_cache_bytes=3 * _block_bytes(model, dirs))
    r = rebase.session()
    r.append(_ids(1, 40))
    with pytest.raises(CacheCapacityError):
        r.generate("plan", max_new_tokens=4)


def test_rows_that_do_not_fit_wait_and_an_idle_session_is_swapped_out_for_them(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared", kv_cache_bytes=5 * _block_bytes(model, dirs))
    a, b = engine.session(), engine.session()
    a.append(_ids(2, 40))
    b.append(_ids(3, 40))
    ra, rb = a.submit("plan", max_new_tokens=4), b.submit("plan", max_new_tokens=4)
    first = engine.step()
    assert first.requests == [ra]  # a takes 3 of the 5 blocks; b's 3 do not fit and it waits
    engine.wait(ra)
    assert ra.outcome().token_ids and not rb.finished
    engine.wait(rb)  # a is idle now: its caches go to host memory so that b runs
    assert a.swapped is not None and a.cache_bytes()["total"] == 0
    assert engine.cache_usage()["allocated"] <= engine.cache_usage()["total"]

    def alone(seed: int, turns: int) -> list[list[int]]:
        s = make_engine(model, dirs, "prelrshared").session()
        s.append(_ids(seed, 40))
        return [s.generate("plan", max_new_tokens=4).token_ids for _ in range(turns)]

    assert rb.outcome().token_ids == alone(3, 1)[0]
    b.close()  # b's blocks come back: a's caches come back in, equal bit for bit
    again = a.generate("plan", max_new_tokens=4)
    assert a.swapped is None and [ra.outcome().token_ids, again.token_ids] == alone(2, 2)
    a.check()
    # a trajectory that cannot come back while the pool is full of a running request: refused
    c = engine.session()
    c.append(_ids(4, 70))
    a.fork(10).close()  # a is resident: forking is fine
    long = c.submit("plan", max_new_tokens=8)
    engine.step()  # c's prefill takes 5 of the 5 blocks: a is swapped out for it
    assert a.swapped is not None
    with pytest.raises(OutOfBlocksError):
        a.fork(10)  # swapping a back in needs blocks the running request holds
    engine.wait(long)
    assert long.outcome().token_ids


@pytest.mark.parametrize("options", [{"block_size": 0}, {"block_size": 2.5}, {"kv_cache_bytes": "1e9"}])
def test_bad_pool_options_are_refused_by_name(tiny, options):
    model, dirs, _ = tiny
    name = next(iter(options))
    with pytest.raises(ValueError, match=name):
        make_engine(model, dirs, "prelrshared", **options)
