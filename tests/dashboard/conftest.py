"""One headless browser per browser test module (a module fixture: starting chromium costs
seconds; Playwright's sync API keeps an event loop running on the main thread while it is open,
so it must be closed before the next module's asyncio tests run). Found, skipped or failed as `browser_testlib` says; launched with the
flags that keep chromium off the network (this machine's network is closed)."""

from __future__ import annotations

import pytest
from browser_testlib import find_browser, no_browser

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        executable = find_browser(p.chromium.executable_path)
        if executable is None:
            no_browser()
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        yield b
        b.close()
