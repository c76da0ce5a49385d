"""Exact aborts, shared by the HTTP clients (SGLang, vLLM): the rids in flight and the re-sends.

SGLang and vLLM look a request id up exactly, so a client remembers the rid of every request it
has in flight (`InFlight`) and aborts a prefix as the matching rids. A request can reach a busy
server after its abort went out; `AbortResends` re-sends the exact abort in the background
while any of the rids is still in flight: after `first_s`, then twice and four times that.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Iterator

from verst.rollout.engine import EngineError

ABORT_RESENDS = 3
"""How many times an exact abort is re-sent for requests still in flight (doubling delays)."""


class InFlight(dict[str, int]):
    """rid → requests in flight with it (one rid may be in flight several times)."""

    @contextlib.contextmanager
    def track(self, rids: Iterable[str]) -> Iterator[None]:
        """Registers `rids` (empty ones skipped) as in flight for the `with` block."""
        rids = [r for r in rids if r]
        for r in rids:
            self[r] = self.get(r, 0) + 1
        try:
            yield
        finally:
            for r in rids:
                left = self.get(r, 1) - 1
                if left > 0:
                    self[r] = left
                else:
                    self.pop(r, None)

    def matching(self, prefix: str) -> list[str]:
        """The rids in flight that start with `prefix`, sorted."""
        return sorted(r for r in self if r.startswith(prefix))


class AbortResends:
    """Background re-sends of exact aborts (`send(rids)`) while their requests are in flight."""

    def __init__(
        self, inflight: InFlight, send: Callable[[list[str]], Awaitable[None]], first_s: float
    ) -> None:
        """`first_s`: the first re-send's delay (0: never re-send)."""
        self.inflight, self.send, self.first_s = inflight, send, first_s
        self._tasks: set[asyncio.Task[None]] = set()

    def schedule(self, rids: list[str]) -> None:
        """Re-send the abort of `rids` in the background (the caller need not wait)."""
        if rids and self.first_s > 0:
            task = asyncio.ensure_future(self._resend(rids))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _resend(self, rids: list[str]) -> None:
        delay = self.first_s
        for _ in range(ABORT_RESENDS):
            await asyncio.sleep(delay)
            left = [r for r in rids if r in self.inflight]
            if not left:
                return
            with contextlib.suppress(EngineError):  # best effort: the first abort already went out
                await self.send(left)
            delay *= 2

    def cancel(self) -> None:
        """Cancel the pending re-sends (the client closes)."""
        for task in list(self._tasks):
            task.cancel()
