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


class RolloutError(RuntimeError):
    """A rollout cannot produce its batch (the engine, a user function or the filters keep
    failing it); the message says what failed, its last error, and how to fix it. The run
    stops: the prompts in play are handed back to the data source and checkpointed."""


class RolloutFailedError(RolloutError):
    """More groups failed in a row (after their retries) than one batch holds: generation or
    scoring is failing consistently, so the rollout stops instead of cycling the dataset."""

    def __init__(
        self, rollout_id: int, errors: list[str], *, source: str = "", label: str = "rollout"
    ) -> None:
        self.num_failed = len(errors)
        """How many groups failed."""
        self.errors = errors
        """One error message per failed group (the groups themselves go back to the data source)."""
        super().__init__(
            f"{label} {rollout_id}: {len(errors)} groups in a row failed after their retries, more than "
            f"the batch needs; last error: {errors[-1] if errors else ''}"
            f"{f' ({source})' if source else ''}. Fix the engine or the function named in the error "
            f"(the log has each failure), or raise rollout.max_group_retries for transient errors"
        )


class EngineUnavailableError(RolloutError):
    """An engine did not answer its health check before the first rollout."""
