"""Find a browser for the dashboard's browser tests, or say how to get one.

Looked for in order: a system `chromium`, `chromium-browser`, `google-chrome` or
`google-chrome-stable` on `PATH`, then Playwright's own managed chromium (what
`playwright install chromium` downloads). With none, the tests skip with one line saying how to
install one; with `VERST_REQUIRE_BROWSER=1` (which `.ci/run` sets after installing chromium)
they fail instead, so a CI box that should have a browser never goes green by skipping.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from require_testlib import required, unavailable

SYSTEM_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
REQUIRE_VAR = "VERST_REQUIRE_BROWSER"
HOW_TO = (
    "no browser for the dashboard tests (looked for "
    + ", ".join(SYSTEM_BROWSERS)
    + " on PATH and Playwright's managed chromium): install one with `apt-get install -y chromium` "
    "or `uv run playwright install chromium`"
)


def find_browser(managed: str | None, which: Callable[[str], str | None] = shutil.which) -> str | None:
    """The executable to drive: a system browser on PATH first, else Playwright's managed build
    (`managed`: the path Playwright would launch, which may not exist), else None."""
    for name in SYSTEM_BROWSERS:
        found = which(name)
        if found:
            return found
    if managed and Path(managed).is_file():
        return managed
    return None


def browser_required(environ: dict[str, str] | None = None) -> bool:
    """Whether a missing browser is a failure (`VERST_REQUIRE_BROWSER=1`) rather than a skip."""
    return required(REQUIRE_VAR, environ)


def no_browser(environ: dict[str, str] | None = None) -> None:
    """Skip (or, under `VERST_REQUIRE_BROWSER=1`, fail) the calling test for want of a browser."""
    unavailable(REQUIRE_VAR, HOW_TO, environ)
