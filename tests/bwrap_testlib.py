"""Whether a test that runs code in the sandbox can run here: where bwrap is missing or cannot
create namespaces it skips with one line saying how to install it; with `VERST_REQUIRE_BWRAP=1`
(which `.ci/run` sets after installing bubblewrap) it fails instead, so a CI box that should
sandbox never goes green by skipping. Top-level in tests/ (next to `conftest.py`), so any test
folder imports it as `bwrap_testlib`; `conftest.bwrap_ok` is the fixture form."""

from __future__ import annotations

from require_testlib import required, unavailable

from verst.rollout.sandbox import SandboxConfig, SandboxPool, SandboxUnavailable

REQUIRE_VAR = "VERST_REQUIRE_BWRAP"


def bwrap_required(environ: dict[str, str] | None = None) -> bool:
    """Whether an unusable bwrap is a failure (`VERST_REQUIRE_BWRAP=1`) rather than a skip."""
    return required(REQUIRE_VAR, environ)


def checked_pool(cfg: SandboxConfig | None = None) -> SandboxPool:
    """A pool whose check passed, or skip / fail (`VERST_REQUIRE_BWRAP=1`) with the one line."""
    pool = SandboxPool(cfg)
    try:
        pool.check()
    except SandboxUnavailable as exc:
        unavailable(REQUIRE_VAR, str(exc))
    return pool
