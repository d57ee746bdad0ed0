"""Scale-out on Ray Serve (precache/cluster): the placement rule against hand-built holdings, then a
live local Ray instance on loopback with 2 replicas of the tiny model: a 3-agent conversation stays
on one replica, concurrent conversations spread, prompt-cache hits and greedy tokens equal a
single-process server's on the same workload, and a replica killed mid-load loses only what it was
streaming."""

from __future__ import annotations

import functools
import json
import math
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from precache.cache.prefix import chain_hashes
from precache.cli import main
from precache.cluster.replica import REPLICA_HEADER, trajectory_holdings
from precache.cluster.routing import ROUTING_KEY, AffinityTable, block_hashes
from tests.test_server_support import BASE, live, tiny_engine, tiny_with_tokenizer

BLOCK = 4  # routing block (tokens): the tiny model's prompts are short
KEYS = ("key-alpha", "key-beta")  # the live cluster's API keys: two tenants
MAX_BYTES = 16 * 1024  # its --max-request-bytes
AGENTS = ("plan", "action", "reflect")


# -- the placement rule, without Ray ------------------------------------------------------------
def test_block_hashes_name_prefixes():
    a, b = list(range(10, 30)), list(range(10, 22)) + [99] * 8
    ha, hb = block_hashes(a, BLOCK), block_hashes(b, BLOCK)
    assert len(ha) == 5 and len(block_hashes(a[:7], BLOCK)) == 1
    assert ha[:3] == hb[:3] and all(x != y for x, y in zip(ha[3:], hb[3:], strict=True))
    assert block_hashes(a, BLOCK) == ha  # equal in every call (and process: no salted hash)
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(a, 0)


def _table(now=None):
    clock = now or (lambda: 0.0)
    return AffinityTable(ttl_s=10.0, clock=clock, seed=0)


def test_a_turn_goes_to_the_replica_holding_its_trajectory_whatever_its_load():
    table = _table()
    turn1 = list(range(40))
    table.record("r1", block_hashes(turn1, BLOCK))
    turn2 = turn1 + [77, 78, 79, 80, 81, 82, 83, 84]
    placement = table.place(block_hashes(turn2, BLOCK), {"r1": 5, "r2": 0}, new_limit=4)
    # r1 is over the new-trajectory limit, yet it keeps the turns of what it holds; r2 is the
    # second rank, which Ray takes only when r1 is full (its max_ongoing_requests)
    assert placement.held and placement.ranks == [["r1"], ["r2"]] and placement.matched_blocks == 10
    placement = table.place(block_hashes(turn2, BLOCK), {"r1": 5, "r2": 4}, new_limit=4)
    assert placement.ranks == [["r1"]]  # r2 takes no new trajectories, spilled turns included


def test_a_shared_system_prompt_alone_is_a_new_trajectory():
    table = _table()
    system = list(range(16))
    table.record("r1", block_hashes(system + [50] * 20, BLOCK))
    other = system + [60] * 20  # same 4 blocks, then its own: it passes through no anchor of r1
    placement = table.place(block_hashes(other, BLOCK), {"r1": 1, "r2": 0}, new_limit=4)
    assert not placement.held and placement.ranks == [["r2", "r1"]]
    # equal loads: the replica sharing the longer prefix comes first
    assert table.place(block_hashes(other, BLOCK), {"r1": 0, "r2": 0}, 4).ranks == [["r1", "r2"]]


def test_overloaded_replicas_shed_new_trajectories_first():
    table = _table()
    new = block_hashes(list(range(50, 70)), BLOCK)
    assert table.place(new, {"r1": 4, "r2": 2}, new_limit=4).ranks == [["r2"]]
    assert table.place(new, {"r1": 4, "r2": 4}, new_limit=4).ranks == []  # it waits in the router
    # requests that start no trajectory (/health, /v1/models) have no limit: least loaded first
    assert table.place((), {"r1": 9, "r2": 7}, new_limit=math.inf).ranks == [["r2", "r1"]]


def test_reports_replace_holdings_sends_expire_and_dead_replicas_are_forgotten():
    now = [0.0]
    table = _table(lambda: now[0])
    prompt = list(range(24))
    hashes = block_hashes(prompt, BLOCK)
    table.record("r1", hashes)
    assert table.match("r1", hashes) == (6, True)
    now[0] = 11.0  # past ttl_s with no report confirming it
    assert table.match("r1", hashes) == (0, False)
    table.report("r2", hashes, [hashes[-1]])
    assert table.place(hashes + [1], {"r1": 0, "r2": 3}, 4).ranks[0] == ["r2"]
    table.forget("r2")
    assert not table.place(hashes, {"r1": 0}, 4).held and table.replicas() == {"r1"}


def test_trajectory_holdings_report_every_block_and_each_prompt_end():
    trajectory = list(range(30))  # prompt of 22 tokens + 8 generated
    stats = trajectory_holdings([(trajectory, 22, None), (list(range(100, 103)), 3, None)], BLOCK)
    hashes = block_hashes(trajectory, BLOCK)
    assert stats["blocks"] == sorted(hashes) and stats["anchors"] == [hashes[22 // BLOCK - 1]]
    assert stats["sessions"] == 2
    # another tenant's trajectory is hashed in its own chain: the router never sends a prompt to it
    salted = trajectory_holdings([(trajectory, 22, "salt:b")], BLOCK)
    assert not set(salted["blocks"]) & set(hashes)
    assert salted["blocks"] == sorted(block_hashes(trajectory, BLOCK, "salt:b"))


def test_routing_hashes_are_the_engines_prefix_chain():
    ids = list(range(40))
    assert block_hashes(ids, BLOCK, "t") == [
        h & ((1 << 63) - 1) for h in chain_hashes(ids, BLOCK, ROUTING_KEY, "t")
    ]


def test_merged_metrics_label_each_source_and_write_each_family_once():
    from prometheus_client import generate_latest

    from precache.cluster.metrics import IngressMetrics, merge_metrics
    from precache.server.metrics import ServerMetrics

    a, b, ingress = ServerMetrics(), ServerMetrics(), IngressMetrics()
    a.error(404, "not_found")
    b.error(404, "not_found")
    b.error(404, "not_found")
    ingress.error(401, "invalid_api_key")
    texts = {name: generate_latest(m.registry).decode() for name, m in (("r1", a), ("r2", b))}
    text = merge_metrics({**texts, "ingress": ingress.text()}).decode()
    samples = _samples(text)
    assert (
        samples[("precache_errors_total", (("code", "not_found"), ("replica", "r1"), ("status", "404")))] == 1
    )
    assert (
        samples[("precache_errors_total", (("code", "not_found"), ("replica", "r2"), ("status", "404")))] == 2
    )
    key = ("precache_errors_total", (("code", "invalid_api_key"), ("replica", "ingress"), ("status", "401")))
    assert samples[key] == 1
    # one HELP and TYPE per family, its samples together (the text format's rule)
    assert text.count("# TYPE precache_errors_total counter") == 1
    families, family = [], None
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            family = line.split()[2]
            families.append(family)
        elif line and not line.startswith("#"):
            assert line.startswith(family), (line, family)  # under its own family's header
    assert len(families) == len(set(families))
    with pytest.raises(ValueError, match="type"):
        merge_metrics({"x": "# TYPE m counter\nm_total 1\n", "y": "# TYPE m gauge\nm 1\n"})


def test_serve_without_ray_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    assert main(["serve", "--replicas", "2"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == 'MissingExtraError: scale-out needs Ray Serve: pip install "precache[cluster]"'
    )


def test_serve_refuses_replica_flags_without_replicas(capsys):
    assert main(["serve", "--num-gpus-per-replica", "1"]) == 2
    assert "--num-gpus-per-replica needs --replicas N or --ray-address ADDR" in capsys.readouterr().err
    assert main(["serve", "--replicas", "0"]) == 2
    assert "--replicas must be at least 1, got 0" in capsys.readouterr().err


def test_serve_replicas_takes_the_security_flags_to_the_ingress(tiny, tmp_path, monkeypatch):
    pytest.importorskip("ray.serve")
    import precache.cluster.app as cluster_app
    from tests.test_server_hostile import _save_tiny_checkpoint

    class Built(Exception):
        pass

    def build_app(spec, tokenizer, vocab_size, max_context, server_config, cluster):
        raise Built(server_config)

    monkeypatch.setattr(cluster_app, "build_app", build_app)
    _save_tiny_checkpoint(tiny, tmp_path / "hf")
    (tmp_path / "keys.txt").write_text("# keys\nkey-from-file\n")
    args = ["serve", "--model", str(tmp_path / "hf"), "--replicas", "2", "--api-key", "k1"]
    args += ["--api-keys", str(tmp_path / "keys.txt"), "--max-request-bytes", "4096"]
    with pytest.raises(Built) as built:
        main([*args, "--trust-client-special-tokens"])
    config = built.value.args[0]
    assert config.api_keys == ("k1", "key-from-file") and config.max_request_bytes == 4096
    assert config.trust_client_special_tokens


# -- a live cluster: 2 replicas on a local Ray instance -----------------------------------------
@pytest.fixture(scope="module")
def cluster(tiny):
    pytest.importorskip("ray.serve")
    import precache
    from precache.cluster.app import ClusterServer, build_app
    from precache.cluster.config import ClusterConfig
    from precache.server import ServerConfig

    model, dirs, _ = tiny
    served = tiny_with_tokenizer(model)
    factory = functools.partial(precache.Engine, served, adapters=dirs, method="prelrshared")
    config = ClusterConfig(
        replicas=2,
        routing_block=BLOCK,
        max_ongoing_requests=8,
        stats_period_s=0.5,
        num_cpus_per_replica=0,
    )
    app = build_app(
        factory,
        served.tokenizer,
        served.config.vocab_size,
        served.max_context,
        ServerConfig(model_name=BASE, api_keys=KEYS, max_request_bytes=MAX_BYTES),
        config,
    )
    with (
        ClusterServer(app, port=0, num_cpus=2) as server,
        httpx.Client(base_url=server.url, timeout=60, headers=_auth(KEYS[0])) as client,
    ):
        yield server, client


@pytest.fixture(scope="module")
def single(tiny):
    """The single-process server over the same model and adapters: the reference."""
    with (
        live(tiny_engine(tiny, "prelrshared")) as (server, _),
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        yield client


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _prompt(k: int) -> list[int]:
    """Trajectory k's first prompt: its own first token, so no two share a block."""
    return [3 + k] + [(7 * k + 5 * i) % 90 + 3 for i in range(35)]


def _complete(client, agent, ids, max_tokens=4) -> tuple[str, dict]:
    r = client.post(
        "/completions",
        json={
            "model": agent,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.headers.get(REPLICA_HEADER), r.json()  # the single server names no replica


def _conversation(client, k: int, turns: int = 3) -> list[tuple[str, list[int], int]]:
    """Agents take turns on one growing trajectory; each turn appends a tool observation.
    Returns ``(replica, generated ids, cached prompt tokens)`` per turn."""
    ids, out = _prompt(k), []
    for turn in range(turns):
        replica, body = _complete(client, AGENTS[turn % 3], ids)
        generated = body["choices"][0]["token_ids"]
        out.append((replica, generated, body["usage"]["prompt_tokens_details"]["cached_tokens"]))
        ids = ids + generated + [(k + turn + i) % 90 + 3 for i in range(6)]
    return out


def test_a_three_agent_conversation_stays_on_one_replica(cluster):
    _, client = cluster
    turns = _conversation(client, 0, turns=4)
    assert len({replica for replica, _, _ in turns}) == 1
    assert turns[0][2] == 0 and all(cached > 0 for _, _, cached in turns[1:])


def test_the_ingress_tokenizes_prompts_as_the_server_does(single, tiny):
    pytest.importorskip("ray.serve")
    from precache.cluster.ingress import prompt_ids, routing_codec

    model = tiny_with_tokenizer(tiny[0])
    codec = routing_codec(model.tokenizer, model.max_context)
    messages = [{"role": "user", "content": "Where is it?"}, {"role": "assistant", "content": "Paris."}]
    requests = [
        ("/v1/completions", {"model": "plan", "prompt": "Where is the Eiffel tower?"}),
        ("/v1/completions", {"model": "plan", "prompt": [5, 6, 7]}),
        ("/v1/chat/completions", {"model": "action", "messages": messages}),
    ]
    for path, body in requests:
        want = single.post(path.removeprefix("/v1"), json={**body, "max_tokens": 1, "return_token_ids": True})
        got = prompt_ids(path, json.dumps(body).encode(), codec, model.config.vocab_size)
        assert got == want.json()["prompt_token_ids"] and len(got) >= 3
    assert prompt_ids("/v1/completions", b'{"model": "plan", "prompt": []}', codec, 96) == []


def test_a_chat_conversation_stays_on_one_replica(cluster):
    _, client = cluster
    messages, served = [{"role": "user", "content": "Plan a trip to the old town."}], []
    for agent in (*AGENTS, "plan"):
        body = {"model": agent, "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = client.post("/chat/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        served.append((r.headers[REPLICA_HEADER], usage["prompt_tokens_details"]["cached_tokens"]))
        answer = r.json()["choices"][0]["message"]["content"]
        messages = [*messages, {"role": "assistant", "content": answer}, {"role": "tool", "content": "ok."}]
    assert len({replica for replica, _ in served}) == 1
    assert all(cached > 0 for _, cached in served[1:])


def test_concurrent_conversations_spread_and_hit_the_cache_as_one_server_does(cluster, single):
    _, client = cluster
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda k: _conversation(client, 10 + k), range(8)))
        want = list(pool.map(lambda k: _conversation(single, 10 + k), range(8)))
    assert all(len({replica for replica, _, _ in turns}) == 1 for turns in got)
    assert len({turns[0][0] for turns in got}) == 2
    assert sum(cached for turns in got for _, _, cached in turns) > 0
    assert [[(ids, cached) for _, ids, cached in turns] for turns in got] == [
        [(ids, cached) for _, ids, cached in turns] for turns in want
    ]


def _events(client, body: dict) -> tuple[int, list]:
    """Status and the SSE events of a streamed request, without their ids and times."""
    with client.stream("POST", "/completions", json=body) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    events = [line if line == "[DONE]" else json.loads(line) for line in lines]
    for event in events:
        if isinstance(event, dict):
            for key in ("id", "created", "session_id"):  # random per response
                event.pop(key, None)
    return r.status_code, events


def test_the_api_answers_errors_and_streams_as_the_single_server_does(cluster, single):
    _, client = cluster
    bad = [
        {"model": "nope", "prompt": [5, 6]},
        {"model": "plan", "prompt": [5, 6], "max_tokens": 0},
        {"model": "plan", "prompt": [500]},
        {"model": "plan", "prompt": []},
    ]
    for body in bad:
        got, want = client.post("/completions", json=body), single.post("/completions", json=body)
        assert (got.status_code, got.json()) == (want.status_code, want.json())
        assert got.status_code >= 400
    ids = [[m["id"] for m in c.get("/models").json()["data"]] for c in (client, single)]
    assert ids[0] == ids[1] == [BASE, *AGENTS]
    body = {"model": "plan", "prompt": _prompt(40), "max_tokens": 5, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
    got, want = _events(client, body), _events(single, body)
    assert got == want and got[0] == 200 and got[1][-1] == "[DONE]"


def test_the_ingress_applies_one_servers_keys_and_body_limit(cluster):
    server, client = cluster
    body = {"model": "plan", "prompt": _prompt(70), "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as anonymous:
        for headers in ({}, _auth("key-gamma"), {"Authorization": "Basic a2V5LWFscGhh"}):
            r = anonymous.post("/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        # as one server (and vLLM): liveness and metrics need no key
        assert anonymous.get(server.url.removesuffix("/v1") + "/health").status_code == 200
    big = {**body, "prompt": "x" * MAX_BYTES}
    r = client.post("/completions", json=big)  # refused on its Content-Length
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    data = json.dumps(big).encode()
    r = client.post("/completions", content=iter([data[:100], data[100:]]))  # chunked: on its bytes
    assert r.status_code == 413 and f"more than {MAX_BYTES}" in r.json()["error"]["message"]
    # each key is a tenant of its own, as on one server: the other key's cache is not read
    replica, first = _complete(client, "plan", _prompt(71))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    with httpx.Client(base_url=server.url, timeout=60, headers=_auth(KEYS[1])) as beta:
        _, other = _complete(beta, "action", _prompt(71))
    _, again = _complete(client, "action", _prompt(71))
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_routing_hashes_are_seeded_with_key_and_salt():
    pytest.importorskip("ray.serve")
    from precache.cluster.ingress import request_tenant

    prompt = _prompt(72)
    salted = json.dumps({"prompt": prompt, "cache_salt": "s"}).encode()
    bare = json.dumps({"prompt": prompt}).encode()
    chains = {
        (key, body): tuple(block_hashes(prompt, BLOCK, request_tenant(key, body)))
        for key in (None, "fingerprint-a", "fingerprint-b")
        for body in (salted, bare)
    }
    assert len(chains) == 6 and all(len(h) == len(prompt) // BLOCK for h in chains.values())
    # no two tenants share one block hash; one tenant's is stable
    assert len({h for hashes in chains.values() for h in hashes}) == 6 * (len(prompt) // BLOCK)
    assert chains[("fingerprint-a", salted)] == tuple(
        block_hashes(prompt, BLOCK, request_tenant("fingerprint-a", salted))
    )


def test_placement_says_nothing_of_another_tenants_prompt(cluster):
    """Issue 24's probe: tenant A sends P; tenant B, a fresh salt each time, sends P plus a few
    tokens. Without the tenant in the router's hashes B landed on A's replica 14 times of 14; now B
    lands there no more often than a control prompt of the same length (both are new trajectories,
    placed on the least loaded replica, ties at random: about half)."""
    server, client = cluster
    secret = _prompt(80)
    for agent in ("plan", "action"):  # A's trajectory, held (anchored) on its replica
        home, _ = _complete(client, agent, secret + ([] if agent == "plan" else [4, 4, 4, 4]))
    trials, probe_hits, control_hits = 24, 0, 0
    with httpx.Client(base_url=server.url, timeout=60, headers=_auth(KEYS[1])) as b:
        for t in range(trials):
            for prompt, is_probe in (
                (secret + [5, 6, 7, 8], True),
                (_random_prompt(t, len(secret) + 4), False),
            ):
                body = {
                    "model": "plan",
                    "prompt": prompt,
                    "max_tokens": 1,
                    "cache_salt": f"probe-{t}-{is_probe}",
                }
                r = b.post("/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                hit = r.headers[REPLICA_HEADER] == home
                probe_hits, control_hits = (
                    probe_hits + (hit and is_probe),
                    control_hits + (hit and not is_probe),
                )
    # a held trajectory would land all 24 probes on A's replica; random placement gives each side
    # Binomial(24, 1/2): the difference exceeds 9 with probability about 0.3%
    assert probe_hits <= control_hits + 9, (probe_hits, control_hits)


def _random_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 93) for _ in range(n)]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_hold_every_replica_labelled_and_the_ingress_refusals(cluster):
    server, client = cluster
    url = server.url.removesuffix("/v1") + "/metrics"
    served = {_complete(client, "plan", _random_prompt(300 + k, 36))[0] for k in range(6)}
    httpx.post(server.url + "/completions", json={"model": "plan", "prompt": [5]})  # no key: 401
    r = httpx.get(url)  # open, as on one server
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = _samples(r.text)
    replicas = {dict(labels).get("replica") for _, labels in samples} - {"ingress"}
    assert replicas >= served and len(replicas) == 2
    assert samples[("precache_cluster_replicas_reporting", (("replica", "ingress"),))] == 2
    key = ("precache_errors_total", (("code", "invalid_api_key"), ("replica", "ingress"), ("status", "401")))
    assert samples[key] >= 1
    # each replica's own counters, as its /metrics counts them: every generation request once
    requests = {
        dict(labels)["replica"]: value
        for (name, labels), value in samples.items()
        if name == "precache_time_to_first_token_seconds_count"
    }
    assert set(requests) == replicas and all(v >= 1 for v in requests.values())


def test_release_idle_drops_every_idle_session_and_no_block_stays_held(cluster):
    server, client = cluster
    for k in range(4):
        _complete(client, AGENTS[k % 3], _random_prompt(400 + k, 40))
    counts = server.release_idle()
    assert sorted(c["replica"] for c in counts) == sorted(server.replica_ids())
    for c in counts:
        assert c["sessions_left"] == c["jobs_left"] == 0 and c["blocks_free"] == c["blocks"] > 0, c


def _stream(client, agent, ids, started: threading.Event, max_tokens: int) -> tuple[str, list[str]]:
    body = {"model": agent, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with client.stream("POST", "/completions", json={**body, "ignore_eos": True}) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                started.set()
        return r.headers[REPLICA_HEADER], events


def test_a_killed_replica_loses_its_streams_only_and_its_trajectories_move(cluster):
    server, client = cluster
    prompts, placed = {}, {}
    # first turns until both replicas hold one and one holds two; a replica restarted by an earlier
    # test may take a while to be routable again, and ties between idle replicas are drawn at random
    for k in range(50, 110):
        replica, body = _complete(client, "plan", _prompt(k))
        prompts[k] = _prompt(k) + body["choices"][0]["token_ids"] + [9, 9, 9, 9]
        placed.setdefault(replica, []).append(k)
        if len(placed) == 2 and max(len(v) for v in placed.values()) >= 2:
            break
        time.sleep(0.25)
    assert len(placed) == 2, f"sixty first turns all went to one replica: {placed}"
    victim = max(placed, key=lambda r: len(placed[r]))
    streamed, unanswered = placed[victim][:2]
    long = 256 - len(prompts[streamed]) - 8  # a long answer: still running when the replica dies
    started = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        quiet = pool.submit(_complete, client, "action", prompts[unanswered], long)
        stream = pool.submit(_stream, client, "reflect", prompts[streamed], started, long)
        assert started.wait(60)
        assert sorted(server.replica_ids()) == sorted(placed)
        server.kill_replica(victim)
        replica, events = stream.result(timeout=60)
        retried, body = quiet.result(timeout=60)
    # the stream had started on the victim: it ends with a readable error, then [DONE]
    assert replica == victim and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "replica_lost"
    # the request that had received nothing is served again elsewhere, whole
    assert retried != victim and len(body["choices"][0]["token_ids"]) == long
    # next turns: the streamed trajectory's caches are lost; the retried one stays where it went
    replica, body = _complete(client, "plan", prompts[streamed] + [11, 12, 13])
    assert replica != victim and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    replica, body = _complete(client, "plan", prompts[unanswered] + [11, 12, 13])
    assert replica == retried and body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def _running(pid: int) -> bool:
    """Process ``pid`` exists and has not exited: a zombie (state ``Z``: exited, its status not yet
    collected by its parent) runs nothing and holds no port or memory."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _descendants(root: int) -> set[int]:
    """Every process under ``root`` now (the ppid tree, from ``ps``)."""
    import subprocess

    rows = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
    children: dict[int, list[int]] = {}
    for row in rows:
        if row.strip():
            pid, ppid = map(int, row.split())
            children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("when", ["serving", "starting"])
def test_sigterm_stops_the_cluster_with_no_ray_process_left(tiny, tmp_path, when):
    """``serve --replicas`` on SIGTERM stops Ray Serve and the Ray instance it started: no process
    it started is alive afterwards, and the log has no native stack dump (issue 24), whether the
    signal comes once it serves or while it starts (Ray's processes up, the app not yet served)."""
    import os
    import signal
    import subprocess
    import sys

    import httpx

    from precache.cluster.app import free_port
    from tests.test_server_hostile import _save_tiny_checkpoint

    hf_dir = tmp_path / "hf"
    _save_tiny_checkpoint(tiny, hf_dir)
    port = free_port("127.0.0.1")
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "precache",
            "serve",
            "--model",
            str(hf_dir),
            "--replicas",
            "1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if when == "starting":  # Ray's GCS, raylet and agents running, start-up not over
                if len(_descendants(proc.pid)) >= 3:
                    assert " replicas (" not in (tmp_path / "serve.log").read_text(errors="replace")
                    break
                time.sleep(0.1)
                continue
            try:  # up, and past its start-up (the line after serve.run returns)
                up = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
                if up and " replicas (" in (tmp_path / "serve.log").read_text(errors="replace"):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError((tmp_path / "serve.log").read_text()[-2000:])
        started = _descendants(proc.pid)
        assert started  # Ray's GCS, raylet, agents, workers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 20  # the children exit after their parent on a loaded machine
        while (alive := [pid for pid in started if _running(pid)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive, subprocess.run(
            ["ps", "-o", "pid,cmd", "-p", ",".join(map(str, alive))], capture_output=True, text=True
        ).stdout
        text = (tmp_path / "serve.log").read_text(errors="replace")
        assert "Aborted" not in text and "Fatal Python error" not in text and "*** SIG" not in text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
