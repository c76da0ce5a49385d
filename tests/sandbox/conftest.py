"""Fixtures of the sandbox tests: a checked pool with small limits, and the after-test checks."""

from __future__ import annotations

import pytest
from sandbox_testlib import checked_pool, leftover_processes, leftover_temp, small_config


@pytest.fixture(scope="module")
def sandbox_ok() -> None:
    """Skip (or fail under VERST_REQUIRE_BWRAP=1) once per module where bwrap cannot sandbox."""
    checked_pool(small_config())


@pytest.fixture
def pool(sandbox_ok: None, tmp_path_factory):
    """A fresh pool with small limits; after the test nothing of it may be left on the host."""
    before = leftover_processes()
    tmp_dir = str(tmp_path_factory.mktemp("sandbox-inputs"))
    yield checked_pool(small_config(tmp_dir))
    assert leftover_processes() - before == set(), "a sandbox left processes behind"
    assert leftover_temp(tmp_dir) == [], "a sandbox left its input folder behind"
