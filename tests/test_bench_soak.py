"""``precache bench soak`` on the tiny model, bounded (10 s of load): the server survives
disconnects, a stalled reader and slowloris sockets with every completed request's tokens equal
to the request run alone and no block leaked; the refusals are counted."""

from __future__ import annotations

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
    assert result["rss_mib"] and all(mib > 0 for _, mib in result["rss_mib"])
