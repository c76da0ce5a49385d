"""Errors that tell the user what is wrong, why, and how to fix it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Problem:
    """One configuration problem."""

    key: str
    """Dotted config key, e.g. `rollout.n_samples_per_prompt`."""
    why: str
    """What is wrong with it."""
    fix: str
    """How to fix it."""

    def __str__(self) -> str:
        return f"- {self.key}: {self.why}\n  fix: {self.fix}"


class ConfigError(ValueError):
    """Invalid configuration: every problem found, each with its fix, in one error."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = list(problems)
        n = len(self.problems)
        header = f"invalid configuration ({n} problem{'s' if n != 1 else ''}):"
        super().__init__("\n".join([header, *map(str, self.problems)]))


class MissingOptionalDependency(ImportError):
    """An optional package is needed for the selected feature; the message names the install command."""


class DataError(ValueError):
    """A malformed dataset row; the message names the file and line."""
