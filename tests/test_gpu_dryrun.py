"""``benchmarks/gpu/run.sh --dry-run``: the prepared GPU benchmark runs end to end on CPU (tiny
config, the kernel in Triton's interpreter) and writes its JSON, markdown and PNG with every part
and every method present, the kernel agreeing with the torch backend on every case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from precache.bench.gpu import LOAD_METHODS, TRACE_METHODS

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_dry_run_writes_every_part(tmp_path):
    out = tmp_path / "gpu"
    child = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), "--dry-run", "--out", str(out)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads((out / "gpu.json").read_text())
    assert result["dry_run"] is True
    cases = result["kernel"]["cases"]
    assert {c["lr"] for c in cases} == {"base", "v", "kv"} and {c["kind"] for c in cases} == {
        "prefill",
        "decode",
    }
    assert all(c["max_abs_error_vs_torch_backend"] < 1e-4 and not c["refused"] for c in cases)
    qv = result["trace"]["qv"]
    assert set(qv["methods"]) == {*TRACE_METHODS, "hf-peft"}
    prefill = {m: e["median"]["prefill_tokens"] for m, e in qv["methods"].items()}
    assert prefill["prelrshared"] < prefill["nonshared"] == prefill["hf-peft"]
    ceiling = qv["ttft_target"]["prefill_token_ceiling"]
    assert ceiling == pytest.approx(prefill["nonshared"] / prefill["prelrshared"])
    levels = result["load"]["levels"]
    assert len(levels) == 2 and all(set(methods) == set(LOAD_METHODS) for methods in levels.values())
    md = (out / "gpu.md").read_text()
    assert "DRY RUN" in md and all(f"| {m} |" in md for m in (*TRACE_METHODS, "hf-peft"))
    png = (out / "gpu.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
