"""Small pieces shared by the engines: request errors, optional-dependency imports, rid helpers."""

from __future__ import annotations

import importlib
import uuid
from typing import Any

from verst.rollout.engine import EngineError
from verst.rollout.errors import MissingOptionalDependency


class InvalidRequest(EngineError, ValueError):
    """A request the engine refuses (bad parameters, prompt longer than the context).

    The server answers these with HTTP 400; the client raises them without retrying, and a
    strategy does not resubmit the group (`retryable` is False): the same request would fail
    again.
    """

    retryable = False


def require(module: str, *, extra: str, feature: str) -> Any:
    """Import an optional module, or raise `MissingOptionalDependency` naming the uv extra.

    Only "not installed" is translated; a package that is installed but fails on import
    propagates its own error.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if exc.name is not None and (exc.name == top or exc.name.startswith(top + ".")):
            raise MissingOptionalDependency(
                f"{feature} needs the optional package {top!r}, which is not installed; "
                f"install it with `uv sync --extra {extra}`"
            ) from exc
        raise


def new_rid() -> str:
    """A fresh request id (uuid4 hex, as SGLang assigns)."""
    return uuid.uuid4().hex
