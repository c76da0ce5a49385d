"""The one rule for opt-in test dependencies (bubblewrap, a browser, the vLLM venv, nemo-gym):
where one is missing its tests skip with one line saying how to get it; with its
`VERST_REQUIRE_<NAME>=1` (which `.ci/run` sets after installing it) they fail with that line
instead, so a CI box that should have it never goes green by skipping. Top-level in tests/
(next to `conftest.py`), so any test folder imports it as `require_testlib`."""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest


def required(var: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether `var` (e.g. `VERST_REQUIRE_BWRAP`) is set to a truthy value: anything but empty or 0."""
    env = os.environ if environ is None else environ
    return env.get(var, "").strip() not in ("", "0")


def unavailable(var: str, how_to: str, environ: Mapping[str, str] | None = None) -> None:
    """Skip the calling test with `how_to`, or fail with it where `var` requires the dependency."""
    if required(var, environ):
        pytest.fail(f"{var}=1 but {how_to}", pytrace=False)
    pytest.skip(how_to)
