"""``precache bench soak`` on the tiny model, bounded (10 s of load): the server survives
disconnects, a stalled reader and slowloris sockets with every completed request's tokens equal
to the request run alone and no block leaked; the refusals are counted."""

from __future__ import annotations

import pytest

from precache.bench.soak import run_soak
from tests.test_server_support import tiny_with_tokenizer


def test_soak_on_the_tiny_model(tiny):
    model, dirs, _ = tiny
    result = run_soak(
        tiny_with_tokenizer(model), dirs, "prelrshared", duration_s=10.0, tenants=3, kv_cache_bytes=None,
        seed=0, verify_limit=60, stall_hold_s=8.0,
    )  # fmt: skip
    assert result["blocks_leaked"] == 0
    assert result["completed"] > 10 and result["checked_alone"] == min(60, result["completed"])
    assert result["tokens_differing_from_alone"] == 0
    assert result["stalled_readers"] >= 1 and result["slowloris_sockets_closed"] >= 4
    metrics = result["server_metrics"]
    assert metrics['precache_refused_total{reason="header_timeout"}'] >= 4
    assert metrics['precache_refused_total{reason="stream_stalled"}'] >= 1
    assert result["outcomes"].get("stream hung up by the client", 0) >= 1
    assert result["rss_mib"] and all(by["server"] > 0 for _, by in result["rss_mib"])
    assert result["sessions_left"] == 0 and result["replica_killed"] is None


def test_soak_on_two_replicas_with_one_killed(tiny, tmp_path):
    """``bench soak --replicas 2``: a replica is killed half-way; no completed request's tokens
    differ from the request alone, the live replicas (the survivor and Ray Serve's replacement)
    hold no block once idle, and the streams the dead replica was serving ended with its error."""
    pytest.importorskip("ray.serve")
    import precache
    from tests.test_server_hostile import _save_tiny_checkpoint

    model, dirs, _ = tiny
    _save_tiny_checkpoint(tiny, tmp_path / "hf")
    checkpoint = precache.load_model(tmp_path / "hf")
    result = run_soak(
        checkpoint, dirs, "prelrshared", duration_s=16.0, tenants=3, kv_cache_bytes=None, seed=1,
        verify_limit=60, stall_hold_s=6.0, replicas=2, model_arg=str(tmp_path / "hf"),
    )  # fmt: skip
    assert result["replica_killed"] is not None and result["replica_killed_at_s"] >= 8
    assert result["completed"] > 10 and result["tokens_differing_from_alone"] == 0
    assert result["blocks_leaked"] == 0 and result["sessions_left"] == 0
    live = {r["replica"] for r in result["released"]}
    assert len(live) == 2 and result["replica_killed"] not in live
    # RSS per replica, the killed one's series ending with it
    seen = {name for _, by in result["rss_mib"] for name in by}
    assert result["replica_killed"] in seen and live <= seen
