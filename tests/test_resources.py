"""The committed adapter sets and shipped traces, resolved by name or by path."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    with pytest.raises(AdapterError, match=f"no PEFT adapter folders .* under {tmp_path}$"):
        adapter_set(tmp_path)


def test_traces_by_shipped_name_or_by_file(tmp_path):
    assert {"smoke", "paper_L1024", "paper_L4096"} <= set(shipped_traces())
    assert trace_path("smoke") == TRACE_ROOT / "smoke.csv"
    own = tmp_path / "smoke"  # an existing file wins over the shipped name
    own.write_text("agent,prefill_len,decode_len\nplan,1,1\n")
    assert trace_path(own) == own
    with pytest.raises(TraceError, match=r"no shipped trace 'paper_L9' \(shipped: .*paper_L1024.*smoke"):
        trace_path("paper_L9")
