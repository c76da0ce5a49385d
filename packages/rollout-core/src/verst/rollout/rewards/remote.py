"""A reward model served over HTTP.

Protocol: `POST url` with JSON `{"prompt": ..., "response": ..., "label": ...}`; the server
answers `{"reward": <float or {name: float}>}` or a bare number. Connection errors, timeouts
and 5xx responses are retried with exponential backoff (`max_retries` times); a 4xx is the
caller's fault and fails at once with the server's message.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from verst.rollout.protocols import RewardValue
from verst.rollout.sample import Sample


class RemoteRewardError(RuntimeError):
    """The remote reward model could not score a sample; the message says why and what to check."""


class RemoteRewardModel:
    """An async `RewardFn` that asks a reward server over HTTP.

    One `aiohttp.ClientSession` per event loop is created on first use; call `aclose()` when done.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.2,
        max_connections: int = 64,
    ) -> None:
        self.url = url
        """Endpoint receiving the POST."""
        self.timeout_s = timeout_s
        """Total timeout of one attempt."""
        self.max_retries = max_retries
        """Retries after the first attempt for retryable failures."""
        self.backoff_s = backoff_s
        """First retry delay; doubles each retry."""
        self.max_connections = max_connections
        """Pooled connections at most."""
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(limit=self.max_connections),
            )
            self._loop = loop
        return self._session

    async def aclose(self) -> None:
        """Close the HTTP session."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __call__(self, sample: Sample) -> RewardValue:
        payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
        return await self.score(payload)

    async def score(self, payload: dict[str, Any]) -> RewardValue:
        """POST one payload and parse the reward, retrying retryable failures."""
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._get_session().post(self.url, json=payload) as resp:
                    body = await resp.text()
                    if resp.status >= 500:
                        last_error = f"HTTP {resp.status}: {body[:200]}"
                        continue
                    if resp.status >= 400:
                        raise RemoteRewardError(
                            f"reward server {self.url} rejected the request with HTTP {resp.status}: "
                            f"{body[:500]}; check that it accepts JSON {{prompt, response, label}}"
                        )
                    return self._parse(body)
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
        raise RemoteRewardError(
            f"reward server {self.url} failed {self.max_retries + 1} times (last: {last_error}); "
            f"check that it is running and reachable, or raise rollout.reward.timeout_s"
        )

    def _parse(self, body: str) -> RewardValue:
        try:
            data = json.loads(body)
        except json.JSONDecodeError:
            raise RemoteRewardError(
                f"reward server {self.url} answered non-JSON {body[:200]!r}; "
                f'it must answer {{"reward": <float>}} or a bare number'
            ) from None
        value = data.get("reward") if isinstance(data, dict) else data
        if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
            raise RemoteRewardError(
                f"reward server {self.url} answered {body[:200]!r}; "
                f'it must answer {{"reward": <float or {{name: float}}>}} or a bare number'
            )
        if isinstance(value, dict):
            return {str(k): float(v) for k, v in value.items()}
        return float(value)
