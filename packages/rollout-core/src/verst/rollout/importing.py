"""Loading objects by import path, with errors that tell "not installed" from "broken"."""

from __future__ import annotations

import importlib
from typing import Any


class ImportPathError(ImportError):
    """An import path could not be resolved; the message says which part failed and why."""


def split_import_path(path: str) -> tuple[str, str]:
    """`"pkg.mod:attr"` or `"pkg.mod.attr"` → `("pkg.mod", "attr")`."""
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ImportPathError(f"{path!r} is not an import path; write it as 'package.module:attribute'")
    return module, attr


def import_object(path: str, *, what: str = "object") -> Any:
    """Import and return the attribute an import path names.

    Raises `ImportPathError` naming the module and attribute, and telling a module that is not
    installed apart from one that fails while importing (whose original error is chained).
    """
    module_name, attr = split_import_path(path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ImportPathError(
                f"cannot load {what} {path!r}: module {missing!r} is not installed "
                f"(check the spelling, or install the package that provides it)"
            ) from exc
        raise ImportPathError(
            f"cannot load {what} {path!r}: module {module_name!r} fails on import because its "
            f"dependency {missing!r} is not installed"
        ) from exc
    except Exception as exc:
        raise ImportPathError(
            f"cannot load {what} {path!r}: module {module_name!r} fails on import: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:20]
        raise ImportPathError(
            f"cannot load {what} {path!r}: module {module_name!r} has no attribute {attr!r} "
            f"(it defines: {', '.join(public)})"
        ) from None
