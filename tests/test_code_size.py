"""Small pieces under packages/: no module over 500 lines, no function over 60 (issue #24, STYLE.md 11).

Reads every `.py` file under `packages/*/src` with `ast` (imports nothing): a module's size is its
line count, a function's (methods and nested functions too) runs from its `def` line to its last
line. `ALLOWED` names the few functions still over the limit while another change splits them;
an entry that is no longer over the limit fails too, so the list only ever shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60

ALLOWED: dict[str, str] = {
    # path under packages/ :: qualified function name -> why it is still allowed (remove when split)
}


def _sources() -> list[Path]:
    files = sorted(p for p in (ROOT / "packages").glob("*/src/**/*.py") if ".venv" not in p.parts)
    assert len(files) > 100, "packages/*/src not found"
    return files


def _functions(tree: ast.Module) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function in `tree`, nested ones included."""
    out: list[tuple[str, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((name, child.end_lineno - child.lineno + 1))
                walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def _measure() -> tuple[dict[str, int], dict[str, int]]:
    """Modules over the limit (path → lines) and every function's size (path::name → lines)."""
    modules, functions = {}, {}
    for path in _sources():
        rel = path.relative_to(ROOT / "packages").as_posix()
        src = path.read_text(encoding="utf-8")
        modules[rel] = len(src.splitlines())
        for name, lines in _functions(ast.parse(src, filename=str(path))):
            functions[f"{rel}::{name}"] = max(lines, functions.get(f"{rel}::{name}", 0))
    return modules, functions


@pytest.fixture(scope="module")
def sizes() -> tuple[dict[str, int], dict[str, int]]:
    return _measure()


def test_no_module_over_500_lines(sizes):
    modules, _ = sizes
    big = {p: n for p, n in modules.items() if n > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them by responsibility): {big}"


def test_no_function_over_60_lines(sizes):
    _, functions = sizes
    big = {f: n for f, n in functions.items() if n > MAX_FUNCTION_LINES and _key(f) not in ALLOWED}
    assert not big, f"functions over {MAX_FUNCTION_LINES} lines (split them by responsibility): {big}"


def test_allow_list_only_names_functions_still_over_the_limit(sizes):
    _, functions = sizes
    stale = [
        k for k in ALLOWED if not any(_key(f) == k and n > MAX_FUNCTION_LINES for f, n in functions.items())
    ]
    assert not stale, f"remove from ALLOWED in tests/test_code_size.py (split or gone): {stale}"


def _key(qualified: str) -> str:
    """`path::Class.method` → `path::method` (the allow-list names functions by their own name)."""
    path, name = qualified.split("::")
    return f"{path}::{name.rsplit('.', 1)[-1]}"


def test_the_measure_sees_a_long_function_in_a_class_and_a_nested_one():
    src = "class A:\n    def f(self):\n" + "        x = 1\n" * 70 + "        def g():\n            pass\n"
    got = dict(_functions(ast.parse(src)))
    assert got == {"A.f": 73, "A.f.g": 2}
