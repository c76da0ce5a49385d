"""Variant tables: a config field whose `type` picks one class of a family, each with its own config.

A family (engines, advantage estimators, policy losses, ...) is one `VariantTable`: a dict from
a built-in name to the variant's config model, plus import paths for user variants
(`type = "my_pkg.module:MyEngine"` names a class whose nested `Config` — or the config class
itself — subclasses the family's base). `table.field` is the annotation of the section field:

    engine: ENGINES.field = Field(default_factory=EmbeddedEngineConfig, ...)

It validates a TOML table with the model its `type` selects (a missing `type` is the family's
default), so pydantic's errors keep their full location (`engine.urls`, not `engine`), and an
unknown name or a bad import path is an error at `<section>.type` that lists the choices. The
resolved config serialises with its own fields (`SerializeAsAny`), so a run's written config
loads back. `verst train --help` and `docs/configuration.md` document every built-in variant
from the same table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Generic, TypeVar

from pydantic import BaseModel, BeforeValidator, SerializeAsAny, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from verst.rollout.importing import ImportPathError, import_object

C = TypeVar("C", bound=BaseModel)


class VariantTable(Generic[C]):
    """One family of variants: built-in name → config model, plus import paths."""

    def __init__(self, family: str, base: type[C], builtins: Mapping[str, type[C]], *, default: str) -> None:
        """`family` names the kind in messages ("engine"); `base` is the config base class every
        variant's config subclasses; `default` is the variant of a table without `type`."""
        if default not in builtins:
            raise ValueError(f"default {default!r} is not one of {sorted(builtins)}")
        self.family = family
        self.base = base
        self.builtins = dict(builtins)
        self.default = default

    @classmethod
    def of_classes(
        cls, family: str, base: type[C], classes: Mapping[str, type], *, default: str
    ) -> VariantTable[C]:
        """The table of variant classes that each nest their `Config` (name → `classes[name].Config`)."""
        return cls(family, base, {name: variant.Config for name, variant in classes.items()}, default=default)

    def __repr__(self) -> str:
        return f"VariantTable({self.family!r}, {sorted(self.builtins)})"

    def choices(self) -> str:
        """The built-in names and the import-path form, for messages."""
        return f"{', '.join(repr(n) for n in self.builtins)}, or an import path 'package.module:Class'"

    def config_class(self, name: str) -> type[C]:
        """The config model of variant `name` (built-in or import path).

        Raises `ValueError` (unknown name, wrong kind of class) or `ImportPathError`."""
        if name in self.builtins:
            return self.builtins[name]
        if ":" not in name and "." not in name:
            raise ValueError(f"unknown {self.family} type {name!r}; choose {self.choices()}")
        obj = import_object(name, what=f"{self.family} type")
        cls = obj if _is_subclass(obj, self.base) else getattr(obj, "Config", None)
        if not _is_subclass(cls, self.base):
            raise ValueError(
                f"{self.family} type {name!r} names {obj!r}, which is neither a "
                f"{self.base.__name__} subclass nor a class with a nested `Config` that is one"
            )
        return cls  # type: ignore[return-value]

    def parse(self, value: Any) -> Any:
        """Validate a table (mapping) — or just a name, for a variant with its defaults — with
        the config model its `type` selects."""
        if isinstance(value, str):
            value = {"type": value}
        if isinstance(value, self.base) or not isinstance(value, Mapping):
            return value  # an instance passes; anything else fails the base model's check
        data = dict(value)
        name = data.setdefault("type", self.default)
        if not isinstance(name, str):
            raise _type_error(f"{self.family} type must be a string; choose {self.choices()}", name)
        try:
            cls = self.config_class(name)
        except (ValueError, ImportPathError) as exc:
            raise _type_error(str(exc), name) from None
        return cls.model_validate(data)

    def build_default(self) -> C:
        """The default variant with default settings."""
        return self.builtins[self.default]()

    @property
    def field(self) -> Any:
        """The annotation of a section field holding one variant of this family."""
        return Annotated[SerializeAsAny[self.base], BeforeValidator(self.parse), self]  # type: ignore[name-defined]


def _is_subclass(obj: Any, base: type) -> bool:
    return isinstance(obj, type) and issubclass(obj, base)


def _type_error(reason: str, name: Any) -> ValidationError:
    """A validation error located at `<section>.type` (pydantic prefixes the section's key)."""
    details = InitErrorDetails(
        type=PydanticCustomError("variant_type", "{reason}", {"reason": reason}), loc=("type",), input=name
    )
    return ValidationError.from_exception_data("variant", [details])


def variant_table_of(field: Any) -> VariantTable[Any] | None:
    """The `VariantTable` a pydantic `FieldInfo` was declared with (`table.field`), else None."""
    for item in getattr(field, "metadata", ()):
        if isinstance(item, VariantTable):
            return item
    return None
