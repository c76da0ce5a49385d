"""One headless browser for every browser test of this folder (a session fixture: starting
chromium costs seconds). Found, skipped or failed as `browser_testlib` says; launched with the
flags that keep chromium off the network (this machine's network is closed)."""

from __future__ import annotations

import pytest
from browser_testlib import browser_required, find_browser, no_browser

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        executable = find_browser(p.chromium.executable_path)
        if executable is None:
            no_browser(required=browser_required())
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        yield b
        b.close()
