"""The engine's configuration: one frozen ``EngineConfig`` built from the keyword arguments (or
passed whole), checked on construction; only the scheduler's limits change on a built engine,
through ``Engine.configure``; apps read the scheduler's queues through read-only properties."""

from __future__ import annotations

import dataclasses

import pytest

import precache
from precache.engine import EngineConfig, SchedulerConfig
from precache.engine.config import EngineOptions
from precache.errors import UnknownMethodError
from tests.tiny import make_engine


def test_the_keyword_arguments_are_the_config_fields():
    assert set(EngineOptions.__annotations__) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert precache.EngineConfig is EngineConfig


def test_keywords_and_a_whole_config_build_the_same_engine(tiny):
    model, dirs, _ = tiny
    options = dict(
        method="fullshared", block_size=8, max_running=3, max_step_tokens=16, swap_space_bytes=2**20
    )
    by_keywords = make_engine(model, dirs, **options)
    whole = precache.Engine(model, dirs, config=EngineConfig(**options))
    assert by_keywords.config == whole.config == EngineConfig(**options)
    assert by_keywords.scheduler.config == SchedulerConfig(max_running=3, max_step_tokens=16)
    assert by_keywords.pool.block_size == 8 and by_keywords.swap_usage()["capacity"] == 2**20
    # keywords replace the fields of a config given whole
    mixed = precache.Engine(model, dirs, config=EngineConfig(**options), max_running=5)
    assert mixed.config == dataclasses.replace(EngineConfig(**options), max_running=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        mixed.config.max_running = 1


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"method": "sharedeverything"}, UnknownMethodError, "sharedeverything"),
        ({"max_adapters": 0}, ValueError, "max_adapters"),
        ({"max_lora_rank": True}, ValueError, "max_lora_rank"),
        ({"swap_space_bytes": -1}, ValueError, "swap_space_bytes"),
        ({"max_running": 0}, ValueError, "scheduler"),
        ({"max_step_tokens": 0}, ValueError, "scheduler"),
    ],
)
def test_a_bad_field_is_refused_on_construction(options, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(**options)


def test_an_unknown_keyword_is_refused(tiny):
    model, dirs, _ = tiny
    with pytest.raises(TypeError, match="kv_cache_size"):
        precache.Engine(model, dirs, kv_cache_size=1 << 20)


def test_configure_changes_only_the_scheduler_limits(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared")
    before = engine.config
    config = engine.configure(max_running=2, max_step_tokens=8)
    assert config is engine.config and config == dataclasses.replace(before, max_running=2, max_step_tokens=8)
    assert engine.scheduler.config == SchedulerConfig(max_running=2, max_step_tokens=8)
    with pytest.raises(TypeError, match="kv_cache_bytes"):
        engine.configure(kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="scheduler"):
        engine.configure(max_running=0)
    assert engine.config is config  # a refused change leaves the config as it was


def test_the_queues_are_read_through_properties(tiny):
    model, dirs, _ = tiny
    engine = make_engine(model, dirs, "prelrshared")
    assert (engine.has_work, engine.num_waiting, engine.num_running) == (False, 0, 0)
    s = engine.session()
    s.append(list(range(1, 9)))
    request = s.submit("plan", max_new_tokens=3, temperature=0.0)
    assert engine.has_work and engine.num_waiting == 0  # queued: it joins the waiting ones at a step
    engine.step()
    assert (engine.num_waiting, engine.num_running) == (0, 1)
    engine.wait(request)
    assert (engine.has_work, engine.num_waiting, engine.num_running) == (False, 0, 0)
    assert len(request.outcome().token_ids) == 3
