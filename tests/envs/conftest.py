"""Fixtures of the environment-ecosystem tests."""

import pytest
from envs_testlib import make_tool_model


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """A tiny chat model over-fitted to call the `add` tool (see envs_testlib)."""
    return make_tool_model(tmp_path_factory.mktemp("tool-model") / "model")
