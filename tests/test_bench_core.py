"""The engine-core benchmarks on a tiny model: capacity fills the pool exactly, batched decode gives
each trajectory its own greedy tokens, an episode replay reproduces the recorded turns."""

from __future__ import annotations

from precache.bench.capacity import resident_trajectories
from precache.bench.decode import engine_decode
from precache.bench.episode_ttft import episode_ttft, replay_recorded
from precache.bench.trace import parse_trace, token_stream
from tests.tiny import make_engine

TRACE = parse_trace("agent,prefill_len,decode_len\nplan,30,4\naction,6,3\nreflect,9,2\nplan,20,3\n", "tiny")


def _streams(i: int) -> list[list[int]]:
    return token_stream(TRACE, vocab_size=96, seed=100 + i)


def _blocks_of_one(model, dirs, method) -> int:
    engine = make_engine(model, dirs, method)
    result = resident_trajectories(engine, TRACE, _streams, limit=1)
    return result["bytes_per_trajectory"] // engine.pool.block_bytes


def test_capacity_keeps_trajectories_until_the_pool_is_full(tiny):
    model, dirs, _ = tiny
    for method in ("nonshared", "prelrshared"):
        per = _blocks_of_one(model, dirs, method)
        probe = make_engine(model, dirs, method, kv_cache_bytes=1 << 20)
        engine = make_engine(
            model, dirs, method, kv_cache_bytes=(3 * per + per // 2) * probe.pool.block_bytes
        )
        result = resident_trajectories(engine, TRACE, _streams)
        assert result["resident"] == 3, method  # a fourth needs `per` blocks, half of them are left
        assert result["bytes_per_trajectory"] == per * engine.pool.block_bytes
        assert result["allocated_bytes"] == 3 * per * engine.pool.block_bytes
    # one trajectory of this trace: NonShared keeps three agents' caches, PreLRShared one base + LR
    assert _blocks_of_one(model, dirs, "nonshared") > 2 * _blocks_of_one(model, dirs, "prelrshared")


def test_batched_decode_gives_each_trajectory_its_own_greedy_tokens(tiny):
    model, dirs, _ = tiny
    prompts = [token_stream(TRACE, vocab_size=96, seed=s)[0] for s in range(4)]
    engine = make_engine(model, dirs, "prelrshared")
    result = engine_decode(engine, "plan", prompts, new_tokens=5)
    assert result["tokens"] == 4 * 4 and result["tokens_per_s"] > 0
    alone = make_engine(model, dirs, "prelrshared")
    want = []
    for p in prompts:
        s = alone.session()
        s.append(p)
        want.append(s.generate("plan", max_new_tokens=5, ignore_eos=True).token_ids)
    assert not engine.scheduler.running
    got = [
        t.token_ids for t in engine.generate_batch(prompts, agent="plan", max_new_tokens=5, ignore_eos=True)
    ]
    assert got == want


def test_episode_replay_reproduces_the_recorded_turns(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "nonshared", prefix_caching=False)
    s = engine.session()
    recorded = []
    for turn, ids in zip(TRACE.turns, token_stream(TRACE, vocab_size=96, seed=3), strict=True):
        s.append(ids)
        recorded.append(s.generate(turn.agent, max_new_tokens=turn.decode_len))
    replayed = replay_recorded(engine, recorded)
    assert [t.token_ids for t in replayed] == [t.token_ids for t in recorded]
    assert [t.prefill_tokens for t in replayed] == [t.prefill_tokens for t in recorded]
    engines = {m: make_engine(model, dirs, m, prefix_caching=False) for m in ("nonshared", "prelrshared")}
    result = episode_ttft(engines, [recorded, recorded])
    assert result["episodes"] == 2 and result["turns"] == 8
    ns, pre = result["methods"]["nonshared"], result["methods"]["prelrshared"]
    assert ns["prefill_tokens"] == 2 * sum(t.prefill_tokens for t in recorded)
    # PreLRShared prefills only what is new: the appended tokens plus the previous turn's last
    # generated token (its other tokens went through decode steps)
    new = sum(len(t.appended) for t in recorded) + len(recorded) - 1
    assert pre["prefill_tokens"] == 2 * new < ns["prefill_tokens"]


def test_decode_step_bytes_count_every_weight_matrix_once_and_each_rows_cache():
    from precache.bench.decode import step_bytes
    from tests.tiny import tiny_model

    model, hf = tiny_model("llama", seed=0, num_layers=2)
    c = model.config
    # every parameter of the HF model but the embedding (one row read), fp32
    weights = 4 * sum(p.numel() for n, p in hf.named_parameters() if "embed_tokens" not in n)
    kv_token = 2 * c.num_layers * c.kv_size * 4
    assert step_bytes(model, 1, 0) == weights
    assert step_bytes(model, 3, 10) == weights + 3 * 10 * kv_token
    model.quantize("int8")
    assert step_bytes(model, 1, 0) < weights / 2  # int8 matrices plus bf16 scales
    assert step_bytes(model, 1, 0, fp32=True) == weights
