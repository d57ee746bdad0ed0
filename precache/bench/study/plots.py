"""The markdown report and PNG plots of ``precache study`` (:mod:`precache.bench.study`)."""

from __future__ import annotations

import os
from pathlib import Path

from precache.bench.plots import plt, save_figure
from precache.bench.study.uncertainty import uncertainty_markdown

HIDDEN_LABELS = {"neutral": "||h^0 - h^c|| / ||h^c||", "previous": "||h^p - h^c|| / ||h^c||"}


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


LEGEND = """Columns: the benchmark's accuracy (HotpotQA: EM, F1; ScienceQA: option accuracy) of the
free-running episodes; `<metric>_drop` = NonShared's minus the method's (positive: a loss);
`agreement`: the share of questions whose final answer equals NonShared's; `turn_match`: the share
of NonShared's turns the method reproduces token for token, in order, up to the first that differs;
`first_kl` / `mean_kl`: teacher-forced KL(NonShared || method) in nats at a turn's first generated
token / over all its generated tokens, on NonShared's recorded trajectories; `k_error_own` /
`k_error_other`: relative K error of the view the reading agent attends to against its own
NonShared cache, over the earlier segments it wrote itself / the other agents wrote; `sum_ttft_s`:
seconds, summed over every turn of the free-running episodes; `prefill_tokens`: summed likewise;
`kv_mib`: the cache blocks a trajectory holds after its last teacher-forced turn (MiB, each block
once, mean over questions; `-`: stored before it was measured)."""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def study_markdown(results: dict) -> str:
    """A title with the run's settings and a legend; per run (benchmark / adapter set): the table,
    the teacher-forced measures per reading agent, Figure 2's means over layers, the sweep."""
    config = results.get("config", {})
    settings = ", ".join(
        f"{key} {config[key]}"
        for key in ("split", "limit", "sweep_limit", "max_steps", "max_new_tokens", "scales", "concurrency")
        if config.get(key) is not None and not (key == "concurrency" and config.get("report_only"))
    )
    lines = ["# precache study", "", f"Settings: {settings}." if settings else "", "", LEGEND, ""]
    for note in results.get("skipped", []):
        lines.append(f"> {note}\n")
    for key, run in results["runs"].items():
        metrics = run["metrics"]
        cols = [*metrics, *(f"{m}_drop" for m in metrics), "agreement", "turn_match"]
        cols += [
            "first_kl",
            "mean_kl",
            "k_error_own",
            "k_error_other",
            "sum_ttft_s",
            "prefill_tokens",
            "kv_mib",
        ]
        lines += [
            f"## {key} ({_count(run['questions'], 'question')})",
            "",
            "| method | " + " | ".join(cols) + " |",
        ]
        lines.append("|---" * (len(cols) + 1) + "|")
        for method, row in run["table"].items():
            kv = row.get("kv_bytes")
            row = {**row, "kv_mib": None if kv is None else kv / 2**20}
            lines.append(f"| {method} | " + " | ".join(_fmt(row[c]) for c in cols) + " |")
        lines += uncertainty_markdown(run)
        lines += [
            "",
            "Teacher-forced, per reading agent (KL in nats; K error of the view over the agent's own "
            "earlier segments / the other agents'):",
            "",
            "| method | agent | turns | first_kl | mean_kl | k_error_own | k_error_other |",
            "|---|---|---|---|---|---|---|",
        ]
        for method, row in run["table"].items():
            for agent, part in row.get("by_agent", {}).items():
                cells = [part[c] for c in ("turns", "first_kl", "mean_kl", "k_error_own", "k_error_other")]
                lines.append(f"| {method} | {agent} | " + " | ".join(_fmt(c) for c in cells) + " |")
        lines += [
            "",
            "Where the free-running episodes part from NonShared's (the agent of the first turn that differs, "
            "or `none` when every turn is NonShared's: questions):",
            "",
        ]
        for method, row in run["table"].items():
            if "parted_at" in row and method != "nonshared":
                lines.append(f"- {method}: " + ", ".join(f"{a} {n}" for a, n in row["parted_at"].items()))
        pairs = run.get("paired") or {}
        if pairs:
            lines += ["", "ReBaseShared-LP against PreLRShared, question by question (exact sign test):", ""]
            for measure, c in pairs.items():
                lines.append(
                    f"- {measure}: ReBaseShared-LP higher on {c['better']}, lower on {c['worse']} "
                    f"questions (p = {c['p']:.3g})"
                )
        for other, pairs in (run.get("paired_own") or {}).items():
            if pairs:
                lines += [
                    "",
                    f"ReBaseOwnShared-LP against {other}, question by question (exact sign test):",
                    "",
                ]
                for measure, c in pairs.items():
                    lines.append(
                        f"- {measure}: ReBaseOwnShared-LP higher on {c['better']}, lower on {c['worse']} "
                        f"questions (p = {c['p']:.3g})"
                    )
        figure2 = run["figure2"]
        mean, across = figure2["mean"], figure2.get("across", len(figure2["transitions"]))
        lines += [
            "",
            f"Figure 2, over {across} hand-overs between two different agents (means over layers, "
            "relative to what the current agent builds from its own hidden states):",
            "",
        ]
        if not across:
            lines.append("- no hand-over between two different agents in these trajectories")
        for method, values in mean.get("k_base_error", {}).items():
            lines.append(f"- K base error, {method}: {_fmt(sum(values) / len(values))}")
        for source, values in mean.get("hidden_error", {}).items():
            lines.append(
                f"- hidden-state error, {HIDDEN_LABELS.get(source, source)}: {_fmt(sum(values) / len(values))}"
            )
        if across:
            lines.append(f"- layers where the neutral base is closer: {figure2['neutral_closer_layers']}")
        lines += [
            "",
            f"Adapter-strength sweep ({_count(run.get('sweep_questions', run['questions']), 'question')}; every B scaled):",
            "",
            "| scale | method | first_kl | mean_kl | agreement | turn_match | " + metrics[0] + " |",
            "|---|---|---|---|---|---|---|",
        ]
        beats_lines = []
        for scale, point in run["sweep"].items():
            for method, row in point["methods"].items():
                cells = [row[c] for c in ("first_kl", "mean_kl", "agreement", "turn_match", metrics[0])]
                lines.append(f"| {scale} | {method} | " + " | ".join(_fmt(c) for c in cells) + " |")
            if point["rebase_beats"]:
                beats = ", ".join(k for k, v in point["rebase_beats"].items() if v) or "nothing"
                beats_lines.append(f"- scale {scale}: ReBaseShared-LP beats PreLRShared on {beats}")
        if beats_lines:
            lines += ["", *beats_lines]
        lines.append("")
    return "\n".join(lines)


def plot_study(results: dict, folder: str | os.PathLike) -> list[Path]:
    """Four PNGs per run ``<benchmark>_<set>_``: ``table.png`` (accuracy drop against NonShared,
    agreement, and the teacher-forced K error over the reader's own and the other agents'
    segments, per method), ``agents.png`` (teacher-forced first and mean KL per reading agent and
    method), ``layers.png`` (Figure 2: K base error per method and hidden-state
    errors per layer), ``sweep.png`` (first-token and mean KL, agreement and accuracy against the adapter scale).
    Returns the paths."""
    folder = Path(folder)
    paths = []
    for key, run in results["runs"].items():
        stem = key.replace("/", "_").replace(os.sep, "_")
        metric = run["metrics"][0]
        methods = list(run["table"])
        fig, (ax_drop, ax_agree, ax_err) = plt.subplots(1, 3, figsize=(18, 4.5))
        ax_drop.bar(methods, [run["table"][m][f"{metric}_drop"] for m in methods])
        ax_agree.bar(methods, [run["table"][m]["agreement"] for m in methods])
        ax_drop.axhline(0, color="black", linewidth=0.8)  # a zero drop is a line, not an empty panel
        ax_drop.set(ylabel=f"{metric} drop vs NonShared", title=key)
        ax_agree.set(ylabel="answer agreement with NonShared", ylim=(0, 1.05), title=key)
        x = range(len(methods))
        for offset, part in ((-0.2, "own"), (0.2, "other")):
            values = [run["table"][m].get(f"k_error_{part}") for m in methods]
            ax_err.bar(
                [i + offset for i in x],
                [v or 0.0 for v in values],
                width=0.4,
                label=f"{part} agents' segments",
            )
            for i, v in enumerate(values):
                if v is None:  # the selective methods: no cache outlives the turn
                    ax_err.text(i + offset, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
        ax_err.set_xticks(list(x), methods)
        ax_err.set(ylabel="relative K error of the view vs NonShared", title="teacher-forced cache error")
        ax_err.legend(fontsize=8)
        for ax in (ax_drop, ax_agree, ax_err):
            ax.tick_params(axis="x", rotation=45)
            ax.grid(alpha=0.3, axis="y")
        paths.append(save_figure(fig, folder / f"{stem}_table.png"))
        agents = sorted({a for m in methods for a in run["table"][m].get("by_agent", {})})
        fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
        width = 0.8 / max(len(methods), 1)
        for j, method in enumerate(methods):
            parts = run["table"][method].get("by_agent", {})
            for ax, measure in zip(axes, ("first_kl", "mean_kl"), strict=True):
                values = [(parts.get(a) or {}).get(measure) or 0.0 for a in agents]
                ax.bar(
                    [i + (j - len(methods) / 2) * width for i in range(len(agents))],
                    values,
                    width,
                    label=method,
                )
        for ax, measure in zip(
            axes, ("first KL (nats)", "mean KL over generated tokens (nats)"), strict=True
        ):
            ax.set_xticks(range(len(agents)), agents)
            ax.set(
                xlabel="reading agent",
                ylabel=measure,
                title=f"{key}: teacher-forced KL vs NonShared per agent",
            )
            ax.grid(alpha=0.3, axis="y")
        if axes[1].get_legend_handles_labels()[0]:  # nothing plotted: no empty legend
            axes[1].legend(fontsize=7)
        paths.append(save_figure(fig, folder / f"{stem}_agents.png"))
        mean = run["figure2"]["mean"]
        fig, (ax_k, ax_h) = plt.subplots(1, 2, figsize=(12, 4.5))
        styles = {"fullshared": ("--", "s"), "prelrshared": ("-", "o"), "rebaseshared": ("-", "^")}
        for method, values in mean.get("k_base_error", {}).items():
            line, marker = styles.get(method, ("-", "o"))
            ax_k.plot(values, linestyle=line, marker=marker, markersize=3, label=method)
        for source, values in mean.get("hidden_error", {}).items():
            ax_h.plot(values, marker="o", markersize=3, label=HIDDEN_LABELS.get(source, source))
        ax_k.set(
            xlabel="layer",
            ylabel="relative K base error",
            title=f"{key}: shared base cache vs own (Figure 2)\n(fullshared = prelrshared where k_proj has no adapter)",
        )
        ax_h.set(
            xlabel="layer", ylabel="relative hidden-state error", title=f"{key}: neutral vs previous agent"
        )
        for ax in (ax_k, ax_h):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # nothing plotted: no empty legend
                ax.legend(fontsize=8)
        paths.append(save_figure(fig, folder / f"{stem}_layers.png"))
        fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
        scales = list(run["sweep"])
        sweep_styles = {
            "nonshared": ("gray", ":", "x"),
            "prelrshared": ("C0", "-", "o"),
            "rebaseshared-lp": ("C1", "--", "^"),
        }
        for method, (color, line, marker) in sweep_styles.items():
            for ax, measure in zip(axes, ("first_kl", "mean_kl", "agreement", metric), strict=True):
                if method == "nonshared" and measure != metric:
                    continue  # the reference: KL 0 and agreement 1 by definition
                values = [run["sweep"][s]["methods"].get(method, {}).get(measure) for s in scales]
                if all(v is not None for v in values):
                    ax.plot(
                        [float(s) for s in scales],
                        values,
                        color=color,
                        linestyle=line,
                        marker=marker,
                        label=method,
                    )
                ax.set(xlabel="adapter scale", ylabel=measure, title=f"{key}: {measure}")
        for ax in axes:
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # nothing plotted: no empty legend
                ax.legend(fontsize=8)
        paths.append(save_figure(fig, folder / f"{stem}_sweep.png"))
    return paths
