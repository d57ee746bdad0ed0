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


def test_rows_that_do_not_fit_wait_instead_of_failing_the_batch(tiny):
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
    engine.wait(rb)  # alone now: its first row runs, and a still holds 3 blocks
    with pytest.raises(OutOfBlocksError):
        rb.outcome()
    assert engine.cache_usage()["allocated"] <= engine.cache_usage()["total"]
    a.close()  # a's blocks come back: b's turn goes through
    b.sync(_ids(3, 40))
    turn = b.generate("plan", max_new_tokens=4)
    want = make_engine(model, dirs, "prelrshared").session()
    want.append(_ids(3, 40))
    assert turn.token_ids == want.generate("plan", max_new_tokens=4).token_ids


@pytest.mark.parametrize("options", [{"block_size": 0}, {"block_size": 2.5}, {"kv_cache_bytes": "1e9"}])
def test_bad_pool_options_are_refused_by_name(tiny, options):
    model, dirs, _ = tiny
    name = next(iter(options))
    with pytest.raises(ValueError, match=name):
        make_engine(model, dirs, "prelrshared", **options)
