"""Switching a variant's `type` with a dotted override (`engine.type="sglang"`).

A variant table in the file (`[engine]` with `type = "embedded"`, `device`, `dtype`, ...) and an
override that changes its type would leave the file's keys of the previous type behind, and the
new type's config refuses them as unknown keys the user never typed on the command line.
`drop_switched_variant_keys` removes exactly those keys — ones the previous type's config has
and the new type's does not, that came from the file and were not set by an override — and
logs one line naming them. Unknown keys (typos) stay, and are reported as usual. The table
form (`engine={type="sglang", urls=[...]}`) replaces the whole table and needs none of this.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from verst.rollout.variants import VariantTable, variant_table_of

logger = logging.getLogger(__name__)


def _table_in(annotation: Any) -> VariantTable[Any] | None:
    """The `VariantTable` inside an `Annotated[...]` annotation (a dict's value type), if any."""
    for item in getattr(annotation, "__metadata__", ()):
        if isinstance(item, VariantTable):
            return item
    return None


def variant_table_at(model: type[BaseModel], path: Sequence[str]) -> VariantTable[Any] | None:
    """The variant table of the table at `path` (`["engine"]`, `["opd", "teachers", "t1"]`)."""
    current: Any = model
    for i, part in enumerate(path):
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(part)
        if field is None:
            return None
        last = i == len(path) - 1
        table = variant_table_of(field)
        if table is not None:
            return table if last else None
        annotation = field.annotation
        if typing.get_origin(annotation) is dict and i == len(path) - 2:
            return _table_in(typing.get_args(annotation)[1])
        current = next(
            (
                a
                for a in (annotation, *typing.get_args(annotation))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            None,
        )
    return None


def _get(data: Any, path: Sequence[str]) -> Any:
    for part in path:
        if not isinstance(data, Mapping):
            return None
        data = data.get(part)
    return data


def _fields(table: VariantTable[Any], name: Any) -> set[str] | None:
    if not isinstance(name, str):
        return None
    try:
        return set(table.config_class(name).model_fields)
    except (ValueError, ImportError):
        return None


def drop_switched_variant_keys(
    model: type[BaseModel],
    file_data: Mapping[str, Any],
    data: dict[str, Any],
    override_paths: Sequence[Sequence[str]],
) -> list[str]:
    """Remove from `data` the file's keys of a variant whose `type` an override changed that only
    the previous type takes (see the module docstring); returns the dotted keys removed."""
    overridden = {tuple(p) for p in override_paths}
    dropped: list[str] = []
    for path in dict.fromkeys(tuple(p[:-1]) for p in override_paths if len(p) >= 2 and p[-1] == "type"):
        table = variant_table_at(model, path)
        before, after = _get(file_data, path), _get(data, path)
        if table is None or not isinstance(before, Mapping) or not isinstance(after, dict):
            continue
        old_type, new_type = before.get("type", table.default), after.get("type", table.default)
        old, new = _fields(table, old_type), _fields(table, new_type)
        if old is None or new is None or old_type == new_type:
            continue
        keys = [k for k in before if k in old and k not in new and (*path, k) not in overridden]
        for k in keys:
            after.pop(k, None)
        if keys:
            names = ", ".join(".".join((*path, k)) for k in keys)
            logger.warning(
                "%s.type=%r on the command line replaces the file's %r: dropped %s (only %r takes them)",
                ".".join(path),
                new_type,
                old_type,
                names,
                old_type,
            )
            dropped += [".".join((*path, k)) for k in keys]
    return dropped
