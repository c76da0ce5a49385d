"""Help generated from the config schema: `verst train --help`'s field list (`describe_model`)
and the Markdown tables of docs/configuration.md (`markdown_section`, written by
scripts/gen_config_reference.py). Every field's type, default and description come from the
pydantic models, variant tables included, so help and docs cannot drift from the schema.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The section model of a field: `Model`, or `Model | None` (an optional section)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _variants(field: Any) -> list[tuple[str, type[BaseModel]]]:
    """(type name, config model) of each built-in variant of a variant-table field, else []."""
    from verst.rollout.variants import variant_table_of

    table = variant_table_of(field)
    return list(table.builtins.items()) if table is not None else []


def _dict_variants(field: Any) -> list[tuple[str, type[BaseModel]]]:
    """The same for a `dict[str, <variant field>]` (e.g. `[opd.teachers.<name>]`), else []."""
    from verst.rollout.variants import VariantTable

    args = typing.get_args(field.annotation)
    if typing.get_origin(field.annotation) is not dict or len(args) != 2:
        return []
    table = next((m for m in getattr(args[1], "__metadata__", ()) if isinstance(m, VariantTable)), None)
    return list(table.builtins.items()) if table is not None else []


def describe_model(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Lines documenting every field of `model` (recursively): `key (type, default): meaning`.
    A variant field (e.g. `[engine]`) documents each built-in variant's fields."""
    nested: list[tuple[str, type[BaseModel], str]] = []
    for name, field in model.model_fields.items():
        variants, key = _variants(field), name
        if not variants:
            variants, key = _dict_variants(field), f"{name}.<name>"
        if variants:
            for type_name, sub in variants:
                doc = f'type = "{type_name}": {sub.__doc__ or ""}'.strip()
                nested.append((key, sub, doc))
            continue
        sub = _nested_model(field.annotation)
        if sub is not None:
            nested.append((name, sub, field.description or ""))
            continue
        if field.default_factory is not None:
            try:
                default = field.default_factory()  # type: ignore[call-arg]
            except TypeError:
                default = "..."
        else:
            default = field.default
        dict_of = typing.get_args(field.annotation)
        if typing.get_origin(field.annotation) is dict and len(dict_of) == 2 and _nested_model(dict_of[1]):
            nested.append((f"{name}.<name>", dict_of[1], field.description or ""))
            continue
        yield f"  {name} = {json.dumps(default, default=str)}   ({_type_name(field.annotation)})"
        if field.description:
            yield f"      {field.description}"
    for name, sub, doc in nested:
        key = f"{prefix}.{name}" if prefix else name
        yield ""
        yield f"[{key}]" + (f"  — {doc}" if doc else "")
        yield from describe_model(sub, key)


def markdown_reference(model: type[BaseModel], section: str, variant: str | None = None) -> str:
    """Markdown tables (`| key | type | default | meaning |`) of a section and its sub-sections;
    `variant` names the variant `model` is (its `type`), shown in the heading."""
    title = f"### `[{section}]`" + (f' — `type = "{variant}"`' if variant else "")
    rows = [title, "", *([model.__doc__.strip(), ""] if variant and model.__doc__ else [])]
    rows += ["| key | type | default | meaning |", "|---|---|---|---|"]
    subs: list[str] = []
    for name, field in model.model_fields.items():
        variants = _variants(field)
        if variants:
            subs += [markdown_reference(m, f"{section}.{name}", t) for t, m in variants]
            default = field.default_factory().type if field.default_factory is not None else None  # type: ignore[call-arg]
            kinds = " \\| ".join(f"'{t}'" for t, _ in variants)
            shown = f'`"{default}"`' if default else "unset"
            rows.append(f"| `{name}` | {kinds} (a name or a table) | {shown} | {field.description or ''} |")
            continue
        variants = _dict_variants(field)
        if variants:
            subs += [markdown_reference(m, f"{section}.{name}.<name>", t) for t, m in variants]
            rows.append(f"| `{name}` | `{{name: table}}` | `{{}}` | {field.description or ''} |")
            continue
        sub = _nested_model(field.annotation)
        if sub is not None:
            subs.append(markdown_reference(sub, f"{section}.{name}"))
            continue
        default = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
        shown = "unset" if default is None else f"`{json.dumps(default, default=str)}`"
        doc = (field.description or "").replace("|", "\\|")
        rows.append(
            f"| `{name}` | `{_type_name(field.annotation).replace('|', chr(92) + '|')}` | {shown} | {doc} |"
        )
    return "\n\n".join(["\n".join(rows), *subs])


def markdown_section(model: type[BaseModel], name: str) -> str:
    """The markdown tables of `model`'s field `name` (every variant of a variant field)."""
    field = model.model_fields[name]
    variants = _variants(field)
    if variants:
        return "\n\n".join(markdown_reference(m, name, t) for t, m in variants)
    return markdown_reference(field.annotation, name)


def config_reference() -> str:
    """Every config section and field with its default and meaning (for `verst train --help`)."""
    from verst.trainer.config import RunConfig

    lines = ["Config reference (TOML sections; override any field with section.key=value):"]
    lines += list(describe_model(RunConfig))
    return "\n".join(lines)
