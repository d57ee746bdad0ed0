"""The core imports and runs with only torch, transformers and safetensors (+ their own
dependencies): ``gguf``, ``bm25s``, ``fastapi``, ``uvicorn`` and ``prometheus_client`` stay inside
the commands that need them, as on a GPU machine that lacks them. A child process whose import
system refuses those packages builds an engine on a tiny random model, runs one turn, imports the
GPU benchmark's modules and parses the CLI's help pages."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

BLOCKED = ("gguf", "bm25s", "fastapi", "uvicorn", "prometheus_client")

CHILD = textwrap.dedent(
    """
    import contextlib, io, json, sys

    BLOCKED = {blocked!r}

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked in this test")
            return None

    sys.meta_path.insert(0, Refuse())
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import precache
    import precache.bench.gpu, precache.bench.gpu_kernel, precache.bench.gpu_report  # the GPU benchmark
    from precache.cli import build_parser
    from precache.models import model_from_hf

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    engine = precache.Engine(model_from_hf(AutoModelForCausalLM.from_config(cfg)), method="prelrshared")
    engine.eos_token_ids = frozenset()
    session = engine.session()
    session.append(list(range(5, 17)))
    turn = session.generate(max_new_tokens=4, temperature=0.0)
    helps = {{}}
    for argv in (["--help"], ["bench", "trace", "--help"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            build_parser().parse_args(argv)
        helps[" ".join(argv)] = out.getvalue()
    print(json.dumps({{"tokens": turn.token_ids, "helps": helps,
                      "loaded": sorted(m for m in BLOCKED if m in sys.modules)}}))
    """
).format(blocked=BLOCKED)


def test_core_runs_without_optional_packages():
    child = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert len(result["tokens"]) == 4 and all(0 <= t < 64 for t in result["tokens"])
    assert result["loaded"] == []
    assert "bench" in result["helps"]["--help"] and "serve" in result["helps"]["--help"]
    assert "--trace" in result["helps"]["bench trace --help"]
