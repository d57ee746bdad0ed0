"""Files that ship inside the package: the committed adapter sets and the benchmark traces.

They live under ``precache/assets/`` (package data, so an installed, non-editable precache finds
them from any directory). Every command that accepts ``--adapters NAME|DIR`` or ``--trace
NAME|FILE`` resolves it here, so the layout (``assets/adapters/smollm2-135m/<set>/<agent>/``,
``assets/traces/<name>.csv``) is written down once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from precache.errors import AdapterError, TraceError

#: package data shipped with precache (adapters, traces, the HotpotQA subset)
ASSETS = Path(__file__).resolve().parent / "assets"
#: the committed PEFT adapters of the embedded SmolLM2-135M-Instruct, one folder per set
ADAPTER_ROOT = ASSETS / "adapters" / "smollm2-135m"
#: ``qv``: LoRA on q_proj and v_proj (the paper's setting); ``all``: the seven projections
ADAPTER_SETS = ("qv", "all")
TRACE_ROOT = ASSETS / "traces"


def adapter_set(name_or_dir: str | os.PathLike, agents: Iterable[str] | None = None) -> dict[str, Path]:
    """Adapter folders by agent name, from a committed set (``qv``, ``all``) or from a folder
    ``DIR`` whose sub-folders ``DIR/<agent>/`` hold PEFT adapters (``adapter_config.json``).

    ``agents``: the agents needed, in the order returned (None: every adapter found, by name).

    Raises:
        AdapterError: the folder holds no adapter, or a needed agent has none; the message names
            the folder and lists the agents found.
    """
    spec = str(name_or_dir)
    committed = spec in ADAPTER_SETS
    folder = ADAPTER_ROOT / spec if committed else Path(spec).expanduser()
    hint = (
        f" (train it with `precache adapters train --set {spec}`)"
        if committed
        else f" (not a committed set either: those are {', '.join(ADAPTER_SETS)})"
    )
    found = {}
    if folder.is_dir():
        found = {p.name: p for p in sorted(folder.iterdir()) if (p / "adapter_config.json").is_file()}
    if not found:
        raise AdapterError(f"no PEFT adapter folders (<agent>/adapter_config.json) under {folder}{hint}")
    wanted = list(agents) if agents is not None else list(found)
    missing = [a for a in wanted if a not in found]
    if missing:
        raise AdapterError(
            f"no adapter for agent(s) {', '.join(missing)} under {folder} (found: {', '.join(found)}){hint}"
        )
    return {a: found[a] for a in wanted}


def shipped_traces() -> list[str]:
    """Names of the shipped traces (``precache/assets/traces/*.csv``: ``paper_L1024``, ``smoke``, ...)."""
    return sorted(p.stem for p in TRACE_ROOT.glob("*.csv"))


def trace_path(name_or_file: str | os.PathLike) -> Path:
    """A trace CSV file: an existing path as given, else the shipped trace of that name
    (``paper_L1024`` -> ``precache/assets/traces/paper_L1024.csv``).

    Raises:
        TraceError: neither a file nor a shipped trace; the message lists the shipped ones.
    """
    path = Path(name_or_file).expanduser()
    if path.is_file():
        return path
    shipped = TRACE_ROOT / f"{name_or_file}.csv"
    if shipped.is_file():
        return shipped
    raise TraceError(
        f"no trace file {path} and no shipped trace '{name_or_file}' (shipped: {', '.join(shipped_traces())})"
    )
