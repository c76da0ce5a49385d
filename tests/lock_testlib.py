"""Read `uv.lock` the way `uv sync` walks it: from the root package through chosen dependency
groups and extras, following each dependency's marker on this machine, to the set of locked
packages that would be installed. Used to prove an install compiles nothing."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import Marker
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename


@dataclass(frozen=True)
class Locked:
    name: str
    version: str | None
    source: dict
    wheels: tuple[str, ...]  # wheel file names
    has_sdist: bool


class Lock:
    def __init__(self, path: Path):
        data = tomllib.loads(path.read_text())
        self._packages: dict[str, list[dict]] = {}
        for pkg in data["package"]:
            self._packages.setdefault(canonicalize_name(pkg["name"]), []).append(pkg)

    def _entries(self, dep: dict) -> list[dict]:
        found = self._packages[canonicalize_name(dep["name"])]
        if "version" in dep:
            found = [p for p in found if p.get("version") == dep["version"]]
        return found

    def installed(self, root: str, groups: list[str], extras: list[str] = ()) -> dict[str, Locked]:
        """Every locked package `uv sync` would install here for `root` with those groups/extras."""
        (top,) = self._packages[canonicalize_name(root)]
        todo = list(top.get("dependencies", []))
        for extra in extras:
            todo += top.get("optional-dependencies", {}).get(extra, [])
        for group in groups:
            todo += top.get("dev-dependencies", {}).get(group, [])
        seen: dict[tuple[str, str | None, tuple[str, ...]], None] = {}
        out: dict[str, Locked] = {}
        while todo:
            dep = todo.pop()
            if "marker" in dep and not Marker(dep["marker"]).evaluate({"extra": ""}):
                continue
            for pkg in self._entries(dep):
                key = (pkg["name"], pkg.get("version"), tuple(dep.get("extra", [])))
                if key in seen:
                    continue
                seen[key] = None
                wheels = tuple(
                    Path(w["url"] if "url" in w else w["path"]).name for w in pkg.get("wheels", [])
                )
                out[pkg["name"]] = Locked(
                    pkg["name"], pkg.get("version"), pkg["source"], wheels, "sdist" in pkg
                )
                todo += pkg.get("dependencies", [])
                for extra in dep.get("extra", []):
                    todo += pkg.get("optional-dependencies", {}).get(extra, [])
        return out


def needs_build(pkg: Locked) -> bool:
    """True when this registry package has no wheel for this interpreter (uv would build its sdist)."""
    if not ("registry" in pkg.source or "url" in pkg.source):
        return False  # workspace members, editables, virtual: built by hatchling, pure Python
    here = set(sys_tags())
    return not any(set(parse_wheel_filename(w)[3]) & here for w in pkg.wheels)
