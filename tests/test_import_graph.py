"""The layering of precache's packages, read from the source with ``ast``: every import counts,
at module top, inside a function or under ``if TYPE_CHECKING:``.

A node is the first name under ``precache/`` (a package such as ``engine``, or a top-level module
such as ``config``; ``precache`` itself is the package's ``__init__``). The rules:

- the core (models, lora, cache, methods, engine and the top-level config, errors, resources,
  registry) never imports an application (agents, bench, server, cluster);
- agents never imports bench (bench runs the agents, not the reverse);
- server and cluster never import each other both ways: a cluster replica runs the server's app
  (cluster -> server), so server -> cluster is refused;
- no cycle between nodes, whether or not ``TYPE_CHECKING``-only imports are counted: such an
  import never runs, but it still says that one package needs the other's types, so the packages
  stack in floors (``lora`` below ``models``, ``models`` below ``cache``; issue 37);
- no module longer than :data:`MAX_MODULE_LINES` lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "precache"
CORE = frozenset(
    {"models", "lora", "cache", "methods", "engine", "compute", "config", "errors", "resources", "registry"}
)
APPS = frozenset({"agents", "bench", "server", "cluster"})
#: (importer, imported) pairs refused besides core -> apps
REFUSED = frozenset({("agents", "bench"), ("server", "cluster")})


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` (nodes) at ``where`` (``path:line``)."""

    source: str
    target: str
    where: str
    type_checking: bool


def _node(module: str) -> str | None:
    """``precache.engine.turn`` -> ``engine``; ``precache`` -> ``precache``; None outside precache."""
    parts = module.split(".")
    if parts[0] != "precache":
        return None
    return parts[1] if len(parts) > 1 else "precache"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, package: str, root: Path) -> list[str]:
    """The modules an import statement names (``from precache import resources`` names the module
    ``precache.resources``; ``from precache import Engine`` the package ``precache``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    if base != "precache":
        return [base]
    return [
        f"precache.{alias.name}"
        if (root / alias.name).is_dir() or (root / f"{alias.name}.py").is_file()
        else "precache"
        for alias in node.names
    ]


def _imports(tree: ast.AST, package: str, root: Path) -> Iterator[tuple[str, int, bool]]:
    """``(module, line, under TYPE_CHECKING)`` for every import in ``tree``, however deeply nested."""

    def walk(node: ast.AST, type_checking: bool) -> Iterator[tuple[str, int, bool]]:
        if isinstance(node, ast.Import | ast.ImportFrom):
            for target in _targets(node, package, root):
                yield target, node.lineno, type_checking
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from walk(child, True)
            for child in node.orelse:
                yield from walk(child, type_checking)
            return
        for child in ast.iter_child_nodes(node):
            yield from walk(child, type_checking)

    yield from walk(tree, False)


def import_edges(root: Path = ROOT) -> list[Edge]:
    """Every import between two different nodes under ``root``."""
    edges = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root.parent)
        module = ".".join(relative.with_suffix("").parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        package = package.removesuffix(".__init__")
        source = _node(module.removesuffix(".__init__"))
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for target_module, line, type_checking in _imports(tree, package, root):
            target = _node(target_module)
            if target is not None and target != source:
                edges.append(Edge(source, target, f"{relative}:{line}", type_checking))
    return edges


def layering_violations(edges: list[Edge]) -> list[str]:
    """The imports that break the rules on the core, agents -> bench and server -> cluster."""
    bad = []
    for e in edges:
        if e.source in CORE and e.target in APPS:
            bad.append(f"{e.where}: the core ({e.source}) imports the application {e.target}")
        elif (e.source, e.target) in REFUSED:
            bad.append(f"{e.where}: {e.source} imports {e.target}")
    return bad


def cycles(edges: list[Edge], type_checking: bool = False) -> list[str]:
    """One line per group of nodes that import each other (directly or through others) by imports
    that run (with ``type_checking``, TYPE_CHECKING-only ones too): a shortest loop through the
    group, each hop with the file and line of one import that makes it."""
    where: dict[tuple[str, str], str] = {}
    graph: dict[str, set[str]] = {}
    for e in edges:
        if type_checking or not e.type_checking:
            graph.setdefault(e.source, set()).add(e.target)
            where.setdefault((e.source, e.target), e.where)

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reach = {node: reachable(node) for node in graph}
    groups = {frozenset(n for n in reach[u] if u in reach.get(n, ())) for u in graph if u in reach[u]}
    found = []
    for group in sorted(groups, key=sorted):
        start = min(group)
        paths, todo = {start: [start]}, [start]
        while todo:  # breadth first inside the group, back to start
            node = todo.pop(0)
            if start in graph[node]:
                loop = [*paths[node], start]
                break
            for nxt in sorted(graph[node] & group):
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    todo.append(nxt)
        hops = " -> ".join(f"{b} ({where[a, b]})" for a, b in zip(loop, loop[1:], strict=False))
        found.append(f"cycle among {', '.join(sorted(group))}: {start} -> {hops}")
    return found


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges()


def test_the_graph_is_read(edges):
    """The walk sees nested and TYPE_CHECKING imports (a graph read wrong would pass every rule)."""
    pairs = {(e.source, e.target) for e in edges}
    assert {("engine", "methods"), ("bench", "agents"), ("cluster", "server"), ("models", "lora")} <= pairs
    assert any(e.type_checking for e in edges)


def test_the_core_never_imports_an_application(edges):
    assert [v for v in layering_violations(edges) if "the core" in v] == []


def test_agents_never_import_bench_and_server_never_imports_cluster(edges):
    assert [v for v in layering_violations(edges) if "the core" not in v] == []


def test_no_cycle_between_packages(edges):
    assert cycles(edges) == []


def test_no_cycle_between_packages_counting_type_only_imports(edges):
    assert cycles(edges, type_checking=True) == []


def test_a_bad_import_is_caught(tmp_path):
    """The checks fail on a planted violation of each rule (a copy of two files' worth of tree)."""
    tree = tmp_path / "precache"
    for name, text in {
        "methods/__init__.py": "def f():\n    from precache.agents import loop\n",
        "agents/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import precache.bench\n",
        "server/cli.py": "from precache.cluster.app import serve_from_args\n",
        "cluster/__init__.py": "from precache import server\n",
        "bench/__init__.py": "",
    }.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    edges = import_edges(tree)
    violations = layering_violations(edges)
    assert len(violations) == 3
    assert any(
        "methods/__init__.py:2: the core (methods) imports the application agents" in v for v in violations
    )
    assert any("agents/__init__.py:3: agents imports bench" in v for v in violations)
    assert any("server/cli.py:1: server imports cluster" in v for v in violations)
    assert cycles(edges) == [
        "cycle among cluster, server: cluster -> server (precache/cluster/__init__.py:1) -> "
        "cluster (precache/server/cli.py:1)"
    ]
    # the type-only import agents -> bench closes no loop; one bench -> agents at run time does
    (tree / "bench/__init__.py").write_text("from precache import agents\n")
    edges = import_edges(tree)
    assert len(cycles(edges)) == 1
    assert (
        "cycle among agents, bench: agents -> bench (precache/agents/__init__.py:3) -> "
        "agents (precache/bench/__init__.py:1)" in cycles(edges, type_checking=True)
    )


#: the longest a module of precache/ may grow (issue 37: a module a newcomer reads in one sitting)
MAX_MODULE_LINES = 350


def test_no_module_is_longer_than_a_newcomer_reads():
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert len(lengths) > 100  # the walk read the package
    assert {p: n for p, n in lengths.items() if n > MAX_MODULE_LINES} == {}
