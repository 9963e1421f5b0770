"""The layers of `proxy/` and what each may import (docs/architecture.md draws the same map).

Two checks, each shown able to fail:

- the import graph, read from the source (every `import`, at any depth, type-only ones
  too): a module imports only its own folder and the folders on floors below it, and the
  graph has no cycle;
- the pure layers import no IO: not httpx, aiosqlite, asyncpg, asyncio, starlette nor
  uvicorn, checked in a fresh interpreter (the test process has imported them all).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import proxy

PACKAGE = Path(proxy.__file__).parent

# Bottom to top. A group may import itself and any group on a lower floor; groups on
# one floor are independent of each other.
FLOORS: list[tuple[str, ...]] = [
    ("proxy.config", "proxy.errors", "proxy.wire"),  # settings, the error tree, bytes
    ("proxy.history",),  # the neutral model of a conversation
    ("proxy.planning", "proxy.dialects"),  # pure planners; one adapter per API
    ("proxy.store", "proxy.record"),  # the store; the request's record
    ("proxy.pipeline",),  # Exchange, Stage, Pipeline
    ("proxy.archive", "proxy.upstream"),  # the archive; the outbound HTTP client
    ("proxy.stages",),  # the stages: planners + store + summarizer
    ("proxy.state",),  # what lives for the life of the app
    ("proxy.edge",),  # the HTTP side: routes, relay, serving
    ("proxy.web",),  # the operator web page
    ("proxy.app",),  # create_app: the wiring
    ("proxy.ops",),  # the `recap` command and its log output
    ("proxy.__main__",),
]

PURE = ("proxy.wire", "proxy.history", "proxy.planning", "proxy.dialects")
IO_MODULES = ("httpx", "aiosqlite", "asyncpg", "asyncio", "starlette", "uvicorn")


def modules(package: Path, name: str = "proxy") -> dict[str, Path]:
    """Every module under `package`, by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = (name, *path.relative_to(package).with_suffix("").parts)
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[dotted] = path
    return out


def imports(path: Path, known: Iterable[str]) -> set[str]:
    """The proxy modules `path` imports, anywhere in it (a name from a package that is a
    module of its own counts as that module)."""
    known = set(known)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "proxy")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] != "proxy":
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
    return out


def group_of(module: str) -> str | None:
    for floor in FLOORS:
        for group in floor:
            if module == group or module.startswith(group + "."):
                return group
    return None


FLOOR = {group: i for i, floor in enumerate(FLOORS) for group in floor}


def violations(graph: Mapping[str, set[str]]) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        group = group_of(module)
        if group is None:
            out.append(f"{module}: in no layer")
            continue
        for target in sorted(targets):
            to = group_of(target)
            if to is None or (to != group and FLOOR[to] >= FLOOR[group]):
                out.append(f"{module} imports {target}")
    return out


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def graph_of(package: Path) -> dict[str, set[str]]:
    """Every module's imports; the package itself (`proxy/__init__.py`, the map of the
    layers in words) is on no floor and must import nothing."""
    mods = modules(package)
    graph = {name: imports(path, mods) - {name} for name, path in mods.items()}
    assert graph.pop("proxy") == set()
    return graph


def test_every_module_imports_only_its_floor_and_below() -> None:
    graph = graph_of(PACKAGE)
    assert len(graph) > 100
    assert violations(graph) == []


def test_the_import_graph_has_no_cycle() -> None:
    assert cycles(graph_of(PACKAGE)) == []


def test_a_planted_wrong_import_is_caught(tmp_path: Path) -> None:
    copy = tmp_path / "proxy"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    messages = copy / "history" / "messages.py"
    messages.write_text(messages.read_text() + "\nfrom proxy.pipeline import Exchange\n")
    graph = graph_of(copy)
    assert violations(graph) == ["proxy.history.messages imports proxy.pipeline"]
    # ... and it closes a cycle: the pipeline imports the messages.
    assert any("proxy.history.messages" in c and "proxy.pipeline" in c for c in cycles(graph))


def test_a_module_outside_every_layer_is_caught(tmp_path: Path) -> None:
    copy = tmp_path / "proxy"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "stray.py").write_text('"""A module in no layer."""\n')
    assert violations(graph_of(copy)) == ["proxy.stray: in no layer"]


def imported_io(*names: str) -> list[str]:
    """The IO modules loaded by importing `names` in a fresh interpreter: if all of a
    layer's modules together load none, none of them does alone."""
    code = (
        f"import sys, importlib; [importlib.import_module(m) for m in {list(names)!r}]; "
        f"print(','.join(m for m in {IO_MODULES!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    return [m for m in out.split(",") if m]


@pytest.mark.parametrize("layer", PURE)
def test_pure_layers_import_no_io(layer: str) -> None:
    names = [m for m in modules(PACKAGE) if group_of(m) == layer]
    assert len(names) > 3
    assert imported_io(*names) == []


def test_the_io_check_sees_io() -> None:
    # The check itself can fail: a stage module does import the store and httpx.
    assert "httpx" in imported_io("proxy.history.messages", "proxy.stages.summarize")
    assert "aiosqlite" in imported_io("proxy.stages.session")
