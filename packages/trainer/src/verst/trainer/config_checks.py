"""Config checks that run before anything heavy loads, each a small function yielding `Problem`s.

- `finite_problems`: every float in the config is finite (`lr = inf` trained; NaN slipped past
  comparisons);
- `optimizer_problems`: the values AdamW would reject, found by building it once over a
  1-element parameter (so every rule of the installed torch is applied, with its key);
- `model_path_problems`: a model path names an existing Hugging Face model directory, or is
  clearly a Hub id (`namespace/name`); a path-like value that does not exist is "not found"
  (it is never sent to the Hub), a directory without `config.json` or weights is "not a model";
- `partial_run_config`: the config built from what validated, so the cross-section checks run
  (and report) even when the schema found problems.

`validate_run_config` composes them; none imports a model or touches the network.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from verst.rollout.errors import Problem

# ---------------------------------------------------------------- numbers


def finite_problems(value: Any, key: str) -> Iterator[Problem]:
    """A problem for every float under `value` (a model, mapping or sequence) that is NaN or ±inf."""
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from finite_problems(getattr(value, name), f"{key}.{name}" if key else name)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from finite_problems(v, f"{key}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from finite_problems(v, f"{key}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        yield Problem(key, f"must be a finite number, got {value}", "set a finite value")


_OPTIMIZER_KEYS = (("beta", "train.betas"), ("epsilon", "train.eps"), ("weight_decay", "train.weight_decay"))


def optimizer_problems(train: Any) -> list[Problem]:
    """What `torch.optim.AdamW` would reject, as a problem under its `train.*` key.

    The rules are torch's own (lr > 0, betas in [0, 1), eps >= 0, ...): AdamW is built with the
    config's values over no parameters, so its argument checks run and then it stops at the empty
    parameter list, before `add_param_group`, whose first call imports torch._dynamo (seconds on
    a small machine, for a command that may only be reporting a typo).
    """
    import torch

    try:
        torch.optim.AdamW(
            [], lr=train.lr, betas=tuple(train.betas), eps=train.eps, weight_decay=train.weight_decay
        )
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        if "empty parameter list" in msg:
            return []  # every argument check passed
        key = next((k for word, k in _OPTIMIZER_KEYS if word in msg.lower()), "train.lr")
        return [
            Problem(
                key,
                f"AdamW rejects it: {msg}",
                "AdamW needs lr > 0, betas in [0, 1), eps > 0, weight_decay >= 0",
            )
        ]
    return []


# ---------------------------------------------------------------- model paths

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""A Hugging Face Hub repo id `namespace/name` (no `--` or `..`, checked separately)."""

WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.gguf", "*.pt")
"""Files of a model directory's weights (any one is enough)."""

HUB_FIX = "a Hugging Face Hub model is written 'namespace/name' (e.g. 'Qwen/Qwen2.5-0.5B-Instruct')"


def is_hub_id(value: str, search_dirs: Sequence[Path] = ()) -> bool:
    """True when `value` clearly names a Hub repo: `namespace/name`, and `namespace` is not a
    local directory (then `value` is a path that does not exist)."""
    if not HUB_ID.match(value) or "--" in value or ".." in value or value.endswith((".", "-")):
        return False
    namespace = value.split("/", 1)[0]
    return not any((d / namespace).exists() for d in (Path.cwd(), *search_dirs))


def model_path_problems(
    key: str, value: str | None, *, search_dirs: Sequence[Path] = (), weights: bool = True
) -> list[Problem]:
    """Problems of a model path: an existing model directory or a Hub id, nothing else.

    `search_dirs` are folders a relative value may be relative to (besides the cwd: the config
    file's folder). `weights=False` checks a tokenizer directory (no weights needed).
    """
    if not value:
        return []
    path = Path(value).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, *(d / path for d in search_dirs)]
    found = next((c for c in candidates if c.exists()), None)
    what = "model" if weights else "tokenizer"
    if found is None:
        if is_hub_id(value, search_dirs):
            return []  # the Hub (or its local cache) is asked when the model loads
        where = "" if path.is_absolute() else f" (looked in {', '.join(str(c.parent) for c in candidates)})"
        return [
            Problem(
                key,
                f"{value!r} not found: no such file or directory{where}",
                f"point it at a local {what} directory; {HUB_FIX}",
            )
        ]
    if not found.is_dir():
        return [
            Problem(
                key,
                f"{str(found)!r} is a file, not a {what} directory",
                f"point it at the directory holding config.json{' and the weights' if weights else ''}",
            )
        ]
    if weights and not (found / "config.json").is_file():
        return [
            Problem(
                key,
                f"{str(found)!r} is a directory but not a Hugging Face model (no config.json in it)",
                "point it at a model directory (config.json + weights), e.g. a checkpoint's model/ folder",
            )
        ]
    if weights and not any(next(found.glob(p), None) for p in WEIGHT_PATTERNS):
        return [
            Problem(
                key,
                f"{str(found)!r} has a config.json but no weights ({', '.join(WEIGHT_PATTERNS)})",
                "point it at a complete model directory (save_pretrained writes config and weights)",
            )
        ]
    return []


def local_model_paths(cfg: Any) -> Iterator[tuple[str, str | None, bool]]:
    """(key, value, needs weights) of every model/tokenizer path this machine loads."""
    yield "train.model_path", cfg.train.model_path, True
    yield "train.ref_model_path", cfg.train.ref_model_path, True
    if cfg.engine.capabilities().needs_model_path:  # loaded here, not by a server
        yield "engine.model_path", getattr(cfg.engine, "model_path", None), True
        yield "engine.tokenizer_path", getattr(cfg.engine, "tokenizer_path", None), False
    for name, teacher in cfg.opd.teachers.items():
        for key, value in teacher.local_model_paths(f"opd.teachers.{name}"):
            yield key, value, True


def model_paths_problems(cfg: Any, *, search_dirs: Sequence[Path] = ()) -> list[Problem]:
    """`model_path_problems` of every local model path of the run."""
    return [
        p
        for key, value, weights in local_model_paths(cfg)
        for p in model_path_problems(key, value, search_dirs=search_dirs, weights=weights)
    ]


# ---------------------------------------------------------------- schema + cross-section together


def _drop(data: dict[str, Any], loc: Sequence[Any]) -> bool:
    """Remove the value at `loc` (or the nearest table above it that exists); True if removed."""
    node: Any = data
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, dict) and part in node:
            if last or not isinstance(node[part], dict | list):
                del node[part]
                return True
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            if last:
                del node[part]
                return True
            node = node[part]
        else:
            return False
    return False


def partial_run_config(
    data: Mapping[str, Any], model: type[BaseModel], *, rounds: int = 8
) -> BaseModel | None:
    """`model` validated from `data` without the values the schema rejects (their defaults
    instead), so the cross-section checks can still run; None if that does not converge."""
    import copy

    current = copy.deepcopy(dict(data))
    for _ in range(rounds):
        try:
            return model.model_validate(current)
        except ValidationError as exc:
            removed = [_drop(current, err["loc"]) for err in exc.errors()]
            if not any(removed):
                return None
    return None


def merge_problems(schema: Sequence[Problem], cross: Sequence[Problem]) -> list[Problem]:
    """Schema problems, then the cross-section ones not about a key the schema already reported
    (those would judge a default that stood in for the rejected value)."""
    bad = {p.key for p in schema}

    def related(key: str) -> bool:
        return any(key == b or key.startswith(b + ".") or b.startswith(key + ".") for b in bad)

    return [*schema, *(p for p in cross if not related(p.key))]


# ---------------------------------------------------------------- pydantic errors as Problems


def _fields_at(model: type[BaseModel], loc: Sequence[Any], data: Any = None) -> dict[str, Any] | None:
    """The fields of the (nested) model at `loc`, or None if it is not a model. `data` (the
    validated input) picks the variant of a variant field (e.g. `[engine]` by its `type`)."""
    from verst.rollout.variants import variant_table_of

    current: Any = model
    for part in loc:
        data = data.get(part) if isinstance(data, Mapping) else None
        if isinstance(current, type) and issubclass(current, BaseModel) and part in current.model_fields:
            field = current.model_fields[part]
            current = _model_in(field.annotation)
            table = variant_table_of(field)
            if table is not None:
                current = _variant_model(table, data) or current
        elif isinstance(part, str) and current is dict:
            current = None
        else:
            return None
        if current is None:
            return None
    if isinstance(current, type) and issubclass(current, BaseModel):
        return dict(current.model_fields)
    return None


def _variant_model(table: Any, data: Any) -> type[BaseModel] | None:
    """The config model a variant table selects for `data`, when it can tell."""
    name = data.get("type", table.default) if isinstance(data, Mapping) else table.default
    try:
        return table.config_class(name) if isinstance(name, str) else None
    except (ValueError, ImportError):
        return None


def _model_in(annotation: Any) -> Any:
    """The pydantic model inside an annotation (`X`, `X | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def problems_from_validation_error(
    exc: ValidationError, model: type[BaseModel], data: Any = None
) -> list[Problem]:
    """Translate pydantic errors: key, why, fix; unknown keys suggest the closest valid key
    (`data`, the input, tells which variant's keys are valid in a variant section)."""
    problems = []
    for err in exc.errors():
        loc = [p for p in err["loc"] if not isinstance(p, int)]
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            valid = _fields_at(model, loc[:-1], data) or {}
            close = difflib.get_close_matches(str(loc[-1]), list(valid), n=1, cutoff=0.5)
            fix = f"did you mean '{'.'.join([*map(str, loc[:-1]), close[0]])}'?" if close else ""
            fix += f" valid keys here: {', '.join(sorted(valid))}" if valid else " remove it"
            problems.append(Problem(key, "unknown key", fix.strip()))
            continue
        fix = "see `verst train --help` for this field's type and meaning"
        valid = _fields_at(model, loc[:-1], data) or {}
        field = valid.get(str(loc[-1])) if loc else None
        if field is not None and field.description:
            fix = f"expected: {field.description}{_default_text(field)}"
        problems.append(Problem(key, f"{err['msg']} (got {err.get('input')!r})", fix))
    return problems


def _default_text(field: Any) -> str:
    """` (default X)` for a field with a default, ` (required)` for one without; nothing for a
    default built by a factory that has no short form (a nested table)."""
    if field.is_required():
        return " (required)"
    if field.default_factory is not None:
        value = field.default_factory()
        return f" (default {value!r})" if isinstance(value, list | dict | tuple) and not value else ""
    return f" (default {field.default!r})"
