"""PNG plots of trace and fidelity results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Write ``fig`` as a PNG at ``path`` (folders created), close it, return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_trace(result: dict, path: str | os.PathLike) -> Path:
    """Two panels: TTFT (ms, median over repeats) per turn, and total KV-cache size (MiB) after
    each turn against the trajectory length, one line per method. Returns the PNG path."""
    fig, (ax_ttft, ax_kv) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, entry in result["methods"].items():
        turns = entry["turns"]
        ax_ttft.plot([t * 1e3 for t in turns["ttft_s"]], marker="o", markersize=3, label=name)
        kv_mib = [b / 2**20 for b in turns["kv_bytes"]]
        ax_kv.plot(result["trajectory_after_turn"], kv_mib, marker="o", markersize=3, label=name)
    ax_ttft.set(xlabel="turn", ylabel="TTFT (ms)", title=f"TTFT per turn, {result['trace']}", yscale="log")
    ax_kv.set(xlabel="trajectory tokens", ylabel="KV cache (MiB)", title="KV cache over the trajectory")
    for ax in (ax_ttft, ax_kv):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_fidelity(result: dict, folder: str | os.PathLike) -> list[Path]:
    """``layer_error.png``: per-layer relative K and V error of each method's view against the
    agent's own NonShared cache; ``kl_per_turn.png``: first-token KL(NonShared || method) per
    agent turn (all episodes in order). Returns the PNG paths."""
    folder = Path(folder)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, summary in result["methods"].items():
        for ax, side in zip(axes, ("k_error", "v_error"), strict=True):
            values = summary[f"{side}_per_layer"]
            if values:
                ax.plot(values, marker="o", markersize=3, label=name)
    for ax, side in zip(axes, ("K", "V"), strict=True):
        ax.set(xlabel="layer", ylabel=f"relative {side} error", title=f"{side} view vs own cache")
        ax.set_yscale("symlog", linthresh=1e-6)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    paths = [save_figure(fig, folder / "layer_error.png")]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name, records in result["per_turn"].items():
        ax.plot([r["first_kl"] for r in records], marker=".", linewidth=0.8, label=name)
    ax.set(xlabel="agent turn", ylabel="KL (nats)", title="first-token KL(NonShared || method) per turn")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, folder / "kl_per_turn.png"))
    return paths
