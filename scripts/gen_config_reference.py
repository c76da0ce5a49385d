"""Regenerate the field tables of `docs/configuration.md` for the trainer-side sections.

The tables between the `<!-- generated: ... -->` markers are produced from the pydantic
schemas (the same descriptions `verst train --help` prints), so the reference cannot drift:
`tests/test_docs_config_reference.py` fails when they are stale. Run after changing a schema:

    uv run python scripts/gen_config_reference.py
"""

from __future__ import annotations

import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
BEGIN = "<!-- generated: run/train/engine/algorithm/opd tables (scripts/gen_config_reference.py) -->"
END = "<!-- end generated -->"


def generated_tables() -> str:
    """The markdown tables of `[run]`, `[train]`, `[engine]`, `[algorithm]` and `[opd]`."""
    from verst.trainer.config import RunConfig
    from verst.trainer.config_reference import markdown_section

    sections = ["run", "train", "engine", "algorithm", "opd"]
    return "\n\n".join(markdown_section(RunConfig, name) for name in sections)


def render(doc: str) -> str:
    """`doc` with the generated region replaced by fresh tables."""
    head, sep, rest = doc.partition(BEGIN)
    if not sep:
        raise SystemExit(f"{DOC}: marker {BEGIN!r} not found")
    _, sep, tail = rest.partition(END)
    if not sep:
        raise SystemExit(f"{DOC}: marker {END!r} not found")
    return f"{head}{BEGIN}\n\n{generated_tables()}\n\n{END}{tail}"


def main() -> int:
    doc = DOC.read_text(encoding="utf-8")
    new = render(doc)
    if "--check" in sys.argv[1:]:
        return 0 if new == doc else 1
    DOC.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
