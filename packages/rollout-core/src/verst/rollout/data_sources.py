"""`rollout.data.source` → the training `DataSource` and the eval sets.

`source` is `"file"` (the default: `PromptDataSource` over `path`), a built-in generated source
from `DATA_SOURCES` (one table entry per source), or an import path `pkg.module:Class`. A
generated source class takes `(options, n_samples_per_prompt, tokenizer=, apply_chat_template=)`,
validates `rollout.data.options` with its nested pydantic `Config` (plus an optional static
`problems(options, key) -> list[Problem]`), and, to serve an eval set, has `samples()` (every
item of a finite source). `GeneratedSource` is that constructor, written once: subclass it and
set the source up in `_start()`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from verst.rollout.config import DataConfig, EvalConfig
from verst.rollout.data import PromptDataSource, check_group_size, load_prompt_samples
from verst.rollout.errors import ConfigError, DataError, MissingOptionalDependency, Problem
from verst.rollout.importing import ImportPathError, import_object
from verst.rollout.sample import Sample

FILE = "file"
DATA_SOURCES: dict[str, str] = {
    "reasoning_gym": "verst.rollout.integrations.reasoning_gym_data:ReasoningGymSource",
    "verifiers": "verst.rollout.integrations.verifiers_env:VerifiersSource",
    "nemo_gym": "verst.rollout.integrations.nemo_gym_env:NemoGymSource",
    "humaneval": "verst.rollout.integrations.humaneval_data:HumanEvalSource",
}
"""Built-in generated data sources: name → import path of the class."""


class GeneratedSource:
    """The constructor a generated source is called with, `(options, n_samples_per_prompt,
    tokenizer=, apply_chat_template=)`: it keeps them and calls `_start()`, where a subclass sets
    itself up from `self.options`."""

    def __init__(
        self,
        options: Any,
        n_samples_per_prompt: int,
        *,
        tokenizer: Any = None,
        apply_chat_template: bool = False,
    ) -> None:
        check_group_size(n_samples_per_prompt)
        self.options = options
        """`rollout.data.options`, validated by the class's nested `Config`."""
        self.n_samples_per_prompt = n_samples_per_prompt
        """Samples per group."""
        self.tokenizer = tokenizer
        """The policy's tokenizer (None in tests that need none)."""
        self.apply_chat_template = apply_chat_template
        """Render prompts with the tokenizer's chat template (`rollout.data.apply_chat_template`)."""
        self._start()

    def _start(self) -> None:
        """Set the source up from `self.options` (read its rows, check them, …)."""


def _class(source: str, key: str) -> tuple[Any, list[Problem]]:
    path = DATA_SOURCES.get(source, source)
    if path is source and ":" not in source and "." not in source:
        valid = [FILE, *DATA_SOURCES]
        return None, [
            Problem(
                f"{key}.source",
                f"unknown data source {source!r}",
                f"use one of {valid} or 'pkg.module:Class'",
            )
        ]
    try:
        return import_object(path, what="data source"), []
    except ImportPathError as exc:
        return None, [
            Problem(f"{key}.source", str(exc), "check the spelling, or install the package that provides it")
        ]


def _options(cls: Any, config: DataConfig, key: str) -> tuple[Any, list[Problem]]:
    model = getattr(cls, "Config", None)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return dict(config.options), []
    try:
        options = model.model_validate(config.options)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            fix = (
                f"valid options: {sorted(model.model_fields)}"
                if err["type"] == "extra_forbidden"
                else "set a valid value"
            )
            problems.append(Problem(f"{key}.options{'.' + loc if loc else ''}", err["msg"], fix))
        return None, problems
    check = getattr(cls, "problems", None)  # optional deeper checks of the options
    try:
        return options, list(check(options, f"{key}.options")) if check else []
    except MissingOptionalDependency as exc:
        return None, [Problem(f"{key}.source", str(exc), "install the extra it names")]


def data_source_problems(config: DataConfig, key: str, *, eval_set: bool = False) -> list[Problem]:
    """Every problem of a generated source's `source`/`options` (nothing for `file`)."""
    if config.source == FILE:
        if config.options:
            return [
                Problem(
                    f"{key}.options", "options are for generated sources; 'file' takes none", "remove them"
                )
            ]
        return []
    if config.path is not None:
        return [
            Problem(
                f"{key}.path",
                f"source {config.source!r} generates its prompts; path is not read",
                "remove path",
            )
        ]
    cls, problems = _class(config.source, key)
    if cls is None:
        return problems
    options, problems = _options(cls, config, key)
    if not problems and eval_set and getattr(options, "size", 0) is None:
        problems.append(Problem(f"{key}.options.size", "an eval set must be finite", "set options.size"))
    return problems


def _build(config: DataConfig, key: str) -> tuple[Any, Any]:
    cls, problems = _class(config.source, key)
    options = None
    if cls is not None:
        options, problems = _options(cls, config, key)
    if problems:
        raise ConfigError(problems)
    return cls, options


def build_data_source(
    config: DataConfig,
    n_samples_per_prompt: int,
    *,
    tokenizer: Any = None,
    max_prompt_tokens: int | None = None,
    vision: Any = None,
) -> Any:
    """The training `DataSource` of `rollout.data` (`max_prompt_tokens` bounds file prompts;
    `vision` is the model's `MultimodalProcessor`, which rows with images need)."""
    if config.source == FILE:
        return PromptDataSource(
            config,
            n_samples_per_prompt,
            tokenizer=tokenizer,
            max_prompt_tokens=max_prompt_tokens,
            vision=vision,
        )
    cls, options = _build(config, "rollout.data")
    return cls(
        options, n_samples_per_prompt, tokenizer=tokenizer, apply_chat_template=config.apply_chat_template
    )


def build_eval_sets(
    eval_config: EvalConfig,
    *,
    tokenizer: Any = None,
    max_prompt_tokens: int | None = None,
    vision: Any = None,
) -> dict[str, list[Sample]]:
    """Named eval sets (one PENDING sample per prompt; the strategy makes the groups), from files
    or finite generated sources.

    An eval file without rows is a `DataError` (it would silently give no eval metrics).
    """
    out: dict[str, list[Sample]] = {}
    for name, ds in eval_config.datasets.items():
        if ds.source == FILE:
            out[name] = load_prompt_samples(
                ds, tokenizer=tokenizer, max_prompt_tokens=max_prompt_tokens, vision=vision
            )
            if not out[name]:
                raise DataError(
                    f"{ds.path}: eval dataset {name!r} has no rows; fix: add prompts to it, or remove "
                    f"rollout.eval.datasets.{name}"
                )
            continue
        cls, options = _build(ds, f"rollout.eval.datasets.{name}")
        out[name] = cls(options, 1, tokenizer=tokenizer, apply_chat_template=ds.apply_chat_template).samples()
    return out
