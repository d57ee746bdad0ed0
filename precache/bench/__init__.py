"""Benchmarks: trace replay (TTFT, latency, throughput, KV bytes) against NonShared and HF + PEFT,
fidelity against NonShared (KL, top-1, per-layer base-cache error, answers), reports and plots.

- ``trace``: trace CSV files, the paper traces, the seeded token stream.
- ``replay``: one replay of a trace on an engine session, per-turn records and totals.
- ``hf_peft``: the HF transformers + PEFT baseline (one ``DynamicCache`` per agent).
- ``suite``: warm-up, repeats, medians and ratios to NonShared over every method.
- ``fidelity``: teacher-forced lockstep comparison of a recorded trajectory under every method.
- ``episodes``: recording NonShared agent episodes, free-running answers, the fidelity summary.
- ``report`` / ``plots``: markdown and rich tables, JSON, PNG plots.
- ``serve`` / ``loadgen``: the serving benchmark, trajectories replayed against the HTTP server.
- ``cli``: ``precache bench trace | serve`` and ``precache fidelity``.
"""
