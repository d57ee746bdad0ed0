"""docs/ARCHITECTURE.md's request paths against the code, so the document cannot go stale silently.

Every module path, record and ``Class.member`` the request paths name exists; each path's stated
counts equal the distinct modules and records of its table's steps; and one request of each kind
(a chat request through the server app, ``Session.generate`` in the library) runs on the tiny
model under a tracer (``sys.setprofile`` on every thread the request crosses): every function of
the table is called, every record of it is built, and every precache module the request touches
is named in that path's section. The decode rows run the captured step's module eagerly
(``compile(compiled=False)``): the same Python modules as the compiled graph, without inductor.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import re
import sys
import threading
from functools import cache
from pathlib import Path

import pydantic
import pytest

import precache
from precache.compute import on_compute

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(precache.__file__).resolve().parent
DOC = REPO / "docs" / "ARCHITECTURE.md"

CODE = re.compile(r"`([^`]+)`")
MODULE_PATH = re.compile(r"^[a-z_]+(?:/[a-z_]+)*\.py$")
DOTTED = re.compile(r"^[a-z_]+(?:\.[a-z_]+)*\.[A-Z]\w*$")  # a record: ``engine.outputs.Turn``
CLASS_MEMBER = re.compile(r"^([A-Z]\w*)(?:\.(\w+))?(?:\(\))?$")  # ``Engine``, ``Engine.step()``
COUNTS = re.compile(r"^Steps (\d+)-(\d+)[^:\n]*: (\d+) modules, (\d+) record types\.$", re.M)
ROW = re.compile(r"^\| (\d+) \|(.*)\|$", re.M)


@dataclasses.dataclass(frozen=True)
class Step:
    number: int
    module: str  # relative to precache/, e.g. "engine/request.py"
    name: str  # the step's function, method or record in that module
    records: tuple[str, ...]  # dotted, relative to precache: "engine.outputs.Turn"


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _request_section() -> str:
    """The document from "## The path of a request" to its end."""
    text = _doc()
    start = text.index("## The path of a request")
    return text[start:]


def _paths() -> dict[str, str]:
    """Each request path's subsection of the request section, by its heading."""
    section = _request_section()
    end = section.find("\n## ", 1)
    parts = re.split(r"^### (.+)$", section[: end if end > 0 else None], flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def _path(kind: str) -> str:
    """The subsection of the chat request (``"chat"``) or of ``Session.generate`` (``"library"``)."""
    key = "chat request" if kind == "chat" else "Session.generate"
    (body,) = [body for title, body in _paths().items() if key in title]
    return body


def _code(cell: str) -> str:
    (value,) = CODE.findall(cell)
    return value


def _steps(body: str) -> list[Step]:
    steps = []
    for number, rest in ROW.findall(body):
        cells = [c.strip() for c in rest.split("|")]
        module, name, hands_on = _code(cells[0]), _code(cells[1]), cells[2]
        steps.append(Step(int(number), module, name, tuple(CODE.findall(hands_on))))
    return steps


def _module(path: str):
    return importlib.import_module("precache." + path.removesuffix(".py").replace("/", "."))


def _resolve(module, dotted: str):
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _record(ref: str) -> type:
    module, _, name = ref.rpartition(".")
    return getattr(importlib.import_module("precache." + module), name)


def _record_module(ref: str) -> str:
    return ref.rpartition(".")[0].replace(".", "/") + ".py"


@cache
def _top_level() -> set[str]:
    """Every module-level function, class and assigned name of precache (``MODEL_REGISTRY``)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


@cache
def _members() -> dict[str, set[str]]:
    """Every class of precache by name -> the names defined in it or in its precache bases."""
    own: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            names = own.setdefault(node.name, set())
            bases.setdefault(node.name, []).extend(b.id for b in node.bases if isinstance(b, ast.Name))
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))

    def all_of(name: str, seen: frozenset = frozenset()) -> set[str]:
        out = set(own.get(name, ()))
        for base in bases.get(name, ()):
            if base not in seen:
                out |= all_of(base, seen | {name})
        return out

    return {name: all_of(name) for name in own}


# -- the document alone --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["chat", "library"])
def test_every_step_names_a_module_and_a_function_or_record_that_exist(kind):
    steps = _steps(_path(kind))
    assert [s.number for s in steps] == list(range(1, len(steps) + 1)), "steps are numbered 1, 2, ..."
    for step in steps:
        assert (PACKAGE / step.module).is_file(), f"step {step.number}: no precache/{step.module}"
        assert callable(_resolve(_module(step.module), step.name)), f"step {step.number}: {step.name}"
        for ref in step.records:
            record = _record(ref)
            assert dataclasses.is_dataclass(record) or issubclass(record, pydantic.BaseModel), (
                f"step {step.number}: {ref} is not a record (a dataclass or a pydantic model)"
            )


@pytest.mark.parametrize("kind", ["chat", "library"])
def test_the_stated_counts_are_the_steps_distinct_modules_and_records(kind):
    body = _path(kind)
    steps = _steps(body)
    stated = COUNTS.findall(body)
    assert stated, "each path states its counts: 'Steps 1-N ...: M modules, R record types.'"
    for first, last, modules, records in stated:
        span = [s for s in steps if int(first) <= s.number <= int(last)]
        assert span and span[-1].number == int(last), f"steps {first}-{last} are not in the table"
        assert len({s.module for s in span}) == int(modules), f"steps {first}-{last}: modules"
        assert len({r for s in span for r in s.records}) == int(records), f"steps {first}-{last}: records"


def test_every_module_record_and_class_the_request_section_names_exists():
    members = _members()
    for token in CODE.findall(_request_section()):
        if MODULE_PATH.match(token):
            path = REPO / token if token.startswith("tests/") else PACKAGE / token
            assert path.is_file(), f"no module {path.relative_to(REPO)}"
        elif DOTTED.match(token):
            assert isinstance(_record(token), type), token
        elif match := CLASS_MEMBER.match(token):
            name, member = match.groups()
            if member is None:
                assert name in _top_level(), f"no class or name {name} in precache"
            else:
                assert name in members, f"no class {name} in precache"
                assert member in members[name], f"{name} has no {member}"


# -- the requests, traced ------------------------------------------------------------------------
class _Tracer:
    """The precache functions called (``(module path, qualified name)``) and the precache classes
    whose ``__init__`` ran (``"engine.request.Request"``), on every thread it is installed on."""

    def __init__(self):
        self.calls: set[tuple[str, str]] = set()
        self.built: set[str] = set()
        self._root = str(PACKAGE) + "/"

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith(self._root):
            self.calls.add((code.co_filename[len(self._root) :], code.co_qualname))
        if code.co_name == "__init__" and "self" in code.co_varnames[:1]:
            kind = type(frame.f_locals.get("self"))
            if kind.__module__.startswith("precache."):
                self.built.add(f"{kind.__module__.removeprefix('precache.')}.{kind.__qualname__}")

    @property
    def modules(self) -> set[str]:
        return {module for module, _ in self.calls}


@contextlib.contextmanager
def _traced():
    """A tracer on this thread, the compute thread and every thread started meanwhile (the server
    app's event loop, its worker threads and the server loop)."""
    tracer = _Tracer()
    threading.setprofile(tracer)
    on_compute(lambda: sys.setprofile(tracer))
    sys.setprofile(tracer)
    try:
        yield tracer
    finally:
        sys.setprofile(None)
        on_compute(lambda: sys.setprofile(None))
        threading.setprofile(None)


def _engine(tiny):
    from tests.test_server_support import tiny_engine

    engine = tiny_engine(tiny, "prelrshared")
    engine.model.compile(compiled=False)  # decode rows through the captured step's module
    return engine


def _check_trace(kind: str, tracer: _Tracer) -> None:
    body = _path(kind)
    for step in _steps(body):
        target = _resolve(_module(step.module), step.name)
        if not isinstance(target, type):
            assert (step.module, step.name) in tracer.calls, (
                f"step {step.number}: {step.module} {step.name} was not called by the request"
            )
        for ref in step.records:
            if dataclasses.is_dataclass(_record(ref)):  # pydantic builds its models in Rust
                assert ref in tracer.built, f"step {step.number}: no {ref} was built"
    named = {t for t in CODE.findall(body) if MODULE_PATH.match(t)}
    named |= {_record_module(t) for t in CODE.findall(body) if DOTTED.match(t)}
    unnamed = sorted(m for m in tracer.modules if m not in named and not m.endswith("__init__.py"))
    assert not unnamed, f"the request touches modules its path in docs/ARCHITECTURE.md never names: {unnamed}"


def test_session_generate_runs_as_the_document_says(tiny):
    engine = _engine(tiny)
    with _traced() as tracer:
        session = engine.session()
        session.append("The quick brown fox")
        turn = session.generate("plan", max_new_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(turn.token_ids) == 3
    _check_trace("library", tracer)


def test_a_chat_request_runs_as_the_document_says(tiny):
    from fastapi.testclient import TestClient

    from precache.server import ServerConfig, create_app
    from tests.test_server_support import BASE

    app = create_app(_engine(tiny), ServerConfig(model_name=BASE))
    body = {"model": "plan", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 3}
    with _traced() as tracer, TestClient(app) as client:
        streamed = client.post("/v1/chat/completions", json={**body, "stream": True, "temperature": 0})
        whole = client.post("/v1/chat/completions", json={**body, "temperature": 0, "ignore_eos": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 3
    _check_trace("chat", tracer)
