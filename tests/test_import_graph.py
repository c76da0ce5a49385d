"""No import circles between verst's modules.

Walks every module under packages/*/src with `ast` (nothing is imported) and builds the graph
of imports between verst modules. Counted: every `import` / `from … import …` statement,
module-level and inside functions (a deferred import that closes a circle is still a circle: it
only moves the failure from import time to call time); not counted: those under
`if TYPE_CHECKING:` (annotations only, never run). `from pkg import name` is an edge to
`pkg.name` when that is a module, else to `pkg`. A module's own parent packages, which Python
imports first anyway, are not edges unless named. Any strongly connected component of two or
more modules fails the test, printed as a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for src in sorted((ROOT / "packages").glob("*/src")):
        for f in sorted(src.rglob("*.py")):
            parts = list(f.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def _statements(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _statements(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, field, []) or []:
                if isinstance(child, ast.stmt):
                    yield from _statements([child])
                elif hasattr(child, "body"):
                    yield from _statements(child.body)


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _statements(ast.parse(path.read_text("utf-8")).body):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
    return {m for m in out if m in mods and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _path(graph: dict[str, set[str]], comp: list[str]) -> str:
    """One concrete loop through a component (shortest, from its first module), for the message."""
    members, start = set(comp), comp[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    loop = [v]
                    while loop[-1] != start:
                        loop.append(parent[loop[-1]])
                    return " -> ".join([start, *reversed(loop[:-1]), start])
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return " <-> ".join(comp)


def test_the_cycle_finder_finds_a_known_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert _path(graph, ["a", "b", "c"]) == "a -> b -> c -> a"
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_imports_inside_functions() -> None:
    graph = import_graph()
    assert len(graph) > 100
    # engines.config builds engines with deferred imports; they are edges
    assert "verst.rollout.engines.embedded.engine" in graph["verst.rollout.engines.config"]


def test_no_import_circles() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(_path(graph, c) for c in found)
