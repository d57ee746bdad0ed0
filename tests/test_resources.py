"""The committed adapter sets and shipped traces, resolved by name or by path."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import precache
from precache.agents import data
from precache.bench.trace import load_trace
from precache.errors import AdapterError, TraceError
from precache.resources import ADAPTER_ROOT, TRACE_ROOT, adapter_set, shipped_traces, trace_path

ROLES = ["plan", "action", "reflect"]


@pytest.mark.parametrize("name", ["qv", "all"])
def test_committed_sets_hold_the_three_role_adapters(name):
    found = adapter_set(name)
    assert sorted(found) == ["action", "plan", "reflect"]
    assert all(path == ADAPTER_ROOT / name / agent for agent, path in found.items())
    assert all((path / "adapter_config.json").is_file() for path in found.values())
    assert list(adapter_set(name, ROLES)) == ROLES  # the order asked for


def test_a_missing_agent_names_the_set_and_what_it_holds():
    with pytest.raises(
        AdapterError, match=r"no adapter for agent\(s\) critic .*found: action, plan, reflect"
    ):
        adapter_set("qv", ["plan", "critic"])
    with pytest.raises(AdapterError, match=r"precache adapters train --set qv"):
        adapter_set("qv", ["critic"])


def test_a_folder_of_agent_adapters(tmp_path, tiny):
    _, dirs, _ = tiny
    root = Path(dirs["plan"]).parent
    assert adapter_set(str(root), ["plan", "reflect"]) == {"plan": root / "plan", "reflect": root / "reflect"}
    with pytest.raises(AdapterError, match=r"no adapter for agent\(s\) critic"):
        adapter_set(root, ["plan", "critic"])
    with pytest.raises(
        AdapterError,
        match=f"no PEFT adapter folders .* under {tmp_path} \\(not a committed set either: those are qv, all\\)$",
    ):
        adapter_set(tmp_path)


def test_traces_by_shipped_name_or_by_file(tmp_path):
    assert {"smoke", "paper_L1024", "paper_L4096"} <= set(shipped_traces())
    assert trace_path("smoke") == TRACE_ROOT / "smoke.csv"
    own = tmp_path / "smoke"  # an existing file wins over the shipped name
    own.write_text("agent,prefill_len,decode_len\nplan,1,1\n")
    assert trace_path(own) == own
    with pytest.raises(TraceError, match=r"no shipped trace 'paper_L9' \(shipped: .*paper_L1024.*smoke"):
        trace_path("paper_L9")


def test_shipped_files_are_package_data_found_from_any_directory(tmp_path, monkeypatch):
    package = Path(precache.__file__).parent
    assert package / "assets" / "adapters" / "smollm2-135m" == ADAPTER_ROOT
    assert package / "assets" / "traces" == TRACE_ROOT
    assert data.hotpotqa_dir() == package / "assets" / "hotpotqa"
    # assets/ is declared package data (test_cli_install installs a wheel and reads them there)
    declared = tomllib.loads((package.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert declared["package-data"]["precache"] == ["assets/**/*"]
    monkeypatch.chdir(tmp_path)  # names resolve wherever the command runs
    assert adapter_set("qv", ROLES) == {a: ADAPTER_ROOT / "qv" / a for a in ROLES}
    assert trace_path("paper_L1024") == TRACE_ROOT / "paper_L1024.csv"
    assert len(data.load_questions("dev")) == 60
    # a relative path is read from the working directory, before the shipped names
    (tmp_path / "mine.csv").write_text("agent,prefill_len,decode_len\nplan,4,2\n")
    assert trace_path("mine.csv") == Path("mine.csv")
    assert load_trace(trace_path("mine.csv")).total_tokens == 6
    with pytest.raises(AdapterError, match=r"no PEFT adapter folders .* under qv2"):
        adapter_set("qv2")
