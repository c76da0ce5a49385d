"""Suite-wide test setup.

`TRITON_INTERPRET=1` must be set before anything imports triton, so it is set at the top of
this file (pytest imports it first): Triton kernels then run on CPU tensors.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random

import pytest

pytest_plugins = ["leak_check"]  # the session-end check that nothing the suite started is left

LEGACY_FLAG = "VERST_USE_LEGACY_ROLLOUT_V1"


@pytest.fixture(autouse=True)
def _clear_legacy_flag(monkeypatch):
    """A developer's shell must not change results: clear the ambient legacy flag."""
    monkeypatch.delenv(LEGACY_FLAG, raising=False)


@pytest.fixture(autouse=True)
def _fixed_seeds():
    """Fix Python's and torch's RNGs per test."""
    random.seed(0)
    try:
        import torch
    except ModuleNotFoundError:
        return
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny Llama + char tokenizer saved in the Hugging Face layout (built, never downloaded)."""
    from verst.rollout.toy import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def bwrap_ok() -> None:
    """Skip where the code sandbox cannot run here, with its one line saying what to install;
    fail instead under `VERST_REQUIRE_BWRAP=1` (`bwrap_testlib`, the rule the sandbox tests use)."""
    from bwrap_testlib import checked_pool

    checked_pool()
