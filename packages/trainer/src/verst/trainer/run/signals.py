"""Graceful stop on SIGINT/SIGTERM: finish the current step, checkpoint, exit cleanly.

The handler object is created by the controller and passed to whoever needs to check it; there
is no module-level flag. A second signal restores the previous handlers' behaviour (a second
Ctrl-C interrupts at once).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class StopRequest:
    """Set by SIGINT/SIGTERM (or by `request()`); the controller polls `requested` between steps."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None
        """Name of the signal that asked to stop (None = not asked, or asked programmatically)."""
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """True once a stop was asked for."""
        return self._event.is_set()

    def request(self, reason: str = "requested") -> None:
        """Ask to stop after the current step."""
        self.signal_name = self.signal_name or reason
        self._event.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._event.is_set():  # second signal: behave as before we were installed
            self.uninstall()
            signal.raise_signal(signum)
            return
        self.signal_name = signal.Signals(signum).name
        self._event.set()

    def install(self) -> StopRequest:
        """Install the handlers (main thread only; elsewhere this is a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were there before `install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> StopRequest:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
