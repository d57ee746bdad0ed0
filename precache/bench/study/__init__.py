"""``precache study``: the PReCache paper's comparison on our engine (issue 12, "The study").

Per benchmark x adapter set, on the questions of one split:

- the paper-style table (:func:`~precache.bench.study.stats.table`), at adapter scale 1: the
  benchmark's accuracy (HotpotQA: EM / F1; ScienceQA: option accuracy), its drop against NonShared
  (NonShared minus the method, so a positive drop is a loss), answer agreement with NonShared
  (:func:`precache.agents.evaluate.summarize`), ``turn_match``
  (:func:`~precache.bench.study.stats.matching_turns`), the sum of TTFT (seconds) and of prefill
  tokens over every turn, and the teacher-forced KL / top-1 of :mod:`precache.bench.fidelity` on
  the recorded NonShared trajectories;
- the paper's Figure 2 diagnostic (:func:`~precache.bench.study.figure2.transition_errors`) on
  those recorded trajectories;
- the adapter-strength sweep: every adapter's B (and LoRA bias) scaled by each factor
  (:func:`~precache.bench.study.run.scaled_adapter`), the same measures for NonShared, PreLRShared
  and ReBaseShared (LP).

One module per job: :mod:`~precache.bench.study.cli` (the command line),
:mod:`~precache.bench.study.run` (running and resuming the points),
:mod:`~precache.bench.study.store` (the stored questions), :mod:`~precache.bench.study.stats`
(the table and the paired tests), :mod:`~precache.bench.study.uncertainty` (confidence intervals
and power), :mod:`~precache.bench.study.figure2` / :mod:`~precache.bench.study.plots` (Figure 2,
the report).
"""
