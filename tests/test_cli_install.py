"""The installed package, run from a directory outside the checkout: the project is installed
(non-editable, ``pip install --target``) into a temporary folder, and the README's library
snippet and commands run from another temporary folder with only that install on the path.

What the README shows is read from README.md itself, so this test follows the README.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
QID = "5a832c3455429954d2e2ec41"


def _fenced(heading: str, lang: str) -> str:
    """The first ``lang`` code block after the README heading ``heading``."""
    section = README.split(f"\n{heading}\n", 1)[1]
    return re.search(rf"```{lang}\n(.*?)```", section, re.S).group(1)


def readme_commands() -> list[list[str]]:
    """Every ``precache ...`` line of the README's command-line block, as argv (comments dropped)."""
    lines = _fenced("## Command line", "bash").splitlines()
    return [shlex.split(line, comments=True)[1:] for line in lines if line.startswith("precache ")]


class Installed:
    """The project installed into ``site`` (scripts in ``site/bin``); commands run in ``cwd``."""

    def __init__(self, root: Path):
        src, self.site, self.cwd = root / "src", root / "site", root / "work"
        src.mkdir()
        self.cwd.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(REPO / name, src / name)
        shutil.copytree(REPO / "precache", src / "precache", ignore=shutil.ignore_patterns("__pycache__"))
        pip = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
        ]
        subprocess.run(
            [*pip, "--target", str(self.site), str(src)], check=True, capture_output=True, timeout=300
        )
        # one OpenMP thread: a 2-core machine shared with the test process gains nothing from two
        self.env = {
            **os.environ,
            "PYTHONPATH": str(self.site),
            "HF_HUB_OFFLINE": "1",
            "COLUMNS": "80",
            "OMP_NUM_THREADS": "1",
        }

    def run(self, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.site / "bin" / "precache"), *argv],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def python(self, code: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    return Installed(tmp_path_factory.mktemp("install"))


def _quiet(stderr: str) -> None:
    """Nothing from the libraries on stderr: no progress bar, no warning, no INFO log."""
    assert "Loading weights" not in stderr and "Warning" not in stderr and "INFO" not in stderr, stderr


def test_the_installed_package_ships_its_adapters_traces_and_questions(installed):
    probe = installed.python(
        "import json, precache, precache.resources as r, precache.agents.data as d\n"
        "print(json.dumps([precache.__file__, {a: str(p) for a, p in r.adapter_set('all').items()},"
        " str(r.trace_path('paper_L1024')), r.shipped_traces(), len(d.load_questions('dev'))]))"
    )
    assert probe.returncode == 0, probe.stderr
    module, adapters, trace, traces, dev = json.loads(probe.stdout)
    package = installed.site / "precache"
    assert Path(module) == package / "__init__.py"  # the install, not the checkout
    assert adapters == {
        a: str(package / "assets/adapters/smollm2-135m/all" / a) for a in ("action", "plan", "reflect")
    }
    assert trace == str(package / "assets/traces/paper_L1024.csv")
    assert traces == sorted(p.stem for p in (REPO / "precache/assets/traces").glob("*.csv"))
    assert dev == 60
    for folder in adapters.values():  # the weights themselves, byte for byte
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shipped = REPO / "precache" / Path(folder).relative_to(package) / name
            assert (Path(folder) / name).read_bytes() == shipped.read_bytes()


def test_every_readme_command_parses_with_the_installed_cli(installed):
    commands = readme_commands()
    assert len(commands) >= 12 and ["demo"] in commands
    code = (
        "import json, sys\nfrom precache.cli import build_parser\n"
        "for argv in json.loads(sys.argv[1]):\n    build_parser().parse_args(argv)\n"
    )
    parsed = subprocess.run(
        [sys.executable, "-c", code, json.dumps(commands)],
        cwd=installed.cwd,
        env=installed.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert parsed.returncode == 0, parsed.stderr


def test_adapters_list_prints_the_whole_table_into_a_pipe(installed):
    listed = installed.run("adapters", "list")
    assert listed.returncode == 0, listed.stderr
    rows = [line for line in listed.stdout.splitlines() if "smollm2-135m" in line]
    assert len(rows) == 12  # 2 benchmarks x 2 sets x 3 roles, each on one line, its folder whole
    folders = installed.site / "precache/assets/adapters"
    expected = [
        (bench, root, name, agent)
        for bench, root in (("hotpotqa", "smollm2-135m"), ("scienceqa", "smollm2-135m-scienceqa"))
        for name in ("qv", "all")
        for agent in ("action", "plan", "reflect")
    ]
    for row, (bench, root, name, agent) in zip(rows, expected, strict=True):
        cells = [c.strip() for c in row.split("│") if c.strip()]
        assert cells[:4] == [bench, name, agent, "8"] and cells[-1] == str(folders / root / name / agent)
    assert max(map(len, rows)) > 80  # COLUMNS=80 would have cut it
    assert listed.stderr == ""


@pytest.mark.slow
def test_the_readme_library_snippet_runs_outside_the_checkout(installed):
    snippet = _fenced("## Library", "python")
    assert 'adapter_set("qv")' in snippet and "adapters/" not in snippet.replace("adapter_set", "")
    ran = installed.python(snippet)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("Thought: ")  # the plan adapter's turn, as the README shows
    last = ran.stdout.strip().splitlines()[-1]  # engine.cache_usage()
    assert last.startswith("{") and "'total'" in last and "'free'" in last


@pytest.mark.slow
def test_readme_commands_run_outside_the_checkout(installed):
    cwd = installed.cwd
    trace = installed.run(
        "-v", "bench", "trace", "--trace", "smoke", "--adapters", "qv", "--methods", "prelrshared",
        "--repeats", "1", "--no-hf-peft", "--json", "trace.json",
    )  # fmt: skip
    assert trace.returncode == 0, trace.stderr
    assert "Loading weights" in trace.stderr  # -v shows the libraries; without it, nothing (below)
    result = json.loads((cwd / "trace.json").read_text())
    rows = (REPO / "precache/assets/traces/smoke.csv").read_text().split()[1:]  # agent,prefill,decode
    expected = (sum(int(p) + int(d) for _, p, d in (r.split(",") for r in rows)), len(rows))
    assert (result["trace_tokens"], result["turns"]) == expected
    assert list(result["methods"]) == ["nonshared", "prelrshared"]

    run = installed.run(
        "run", "--question", QID, "--adapters", "qv", "--max-steps", "1", "--max-new-tokens", "8",
        "--json", "run.json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    _quiet(run.stderr)
    episode = json.loads((cwd / "run.json").read_text())
    assert episode["adapters"] == "qv" and episode["turns"][0]["agent"] == "plan"

    record = json.loads((REPO / "precache/assets/hotpotqa/easy.jsonl").read_text().splitlines()[0])
    (cwd / "questions.jsonl").write_text(json.dumps(record) + "\n")
    own = installed.run(
        "eval", "--data", "questions.jsonl", "--adapters", str(installed.site / "precache/assets/adapters/smollm2-135m/qv"),
        "--max-steps", "1", "--max-new-tokens", "8", "--json", "eval.json",
    )  # fmt: skip
    assert own.returncode == 0, own.stderr
    _quiet(own.stderr)
    evaluated = json.loads((cwd / "eval.json").read_text())
    assert [e["question_id"] for e in evaluated["episodes"]] == [record["id"]]
    assert evaluated["summary"]["questions"] == 1 and "agreement" in evaluated["summary"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_serve_logs_serving_once_it_accepts(installed):
    port = _free_port()
    plan = installed.site / "precache/assets/adapters/smollm2-135m/qv/plan"
    argv = [
        str(installed.site / "bin/precache"),
        "serve",
        "--lora-modules",
        f"plan={plan}",
        "--port",
        str(port),
    ]
    server = subprocess.Popen(argv, cwd=installed.cwd, env=installed.env, stderr=subprocess.PIPE, text=True)
    try:
        before = []
        while "serving" not in (line := server.stderr.readline()) and line:
            before.append(line)
        assert f"on http://127.0.0.1:{port}/v1" in line, before
        assert not any("uvicorn" in b.lower() or "INFO" in b for b in before), before  # quiet
        # logged once the socket accepts: the request right after the line is answered
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as response:
            models = json.loads(response.read())
        assert {m["id"] for m in models["data"]} >= {"plan"}
        taken = installed.run("serve", "--port", str(port), timeout=120)
        assert taken.returncode == 2 and taken.stdout == ""
        assert taken.stderr.count("\n") == 1 and "Address already in use" in taken.stderr
    finally:
        server.terminate()
        server.wait(timeout=60)
