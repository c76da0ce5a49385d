"""A reward model served over HTTP.

Protocol: `POST url` with JSON `{"prompt": ..., "response": ..., "label": ...}`; the server
answers `{"reward": <float or {name: float}>}` or a bare number. Connection errors, timeouts
and 5xx responses are retried with exponential backoff (`max_retries` times); a 4xx is the
caller's fault and fails at once with the server's message.
"""

from __future__ import annotations

import json
from typing import Any

from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.common.http import HttpSettings, HttpStatusError, RetriesExhausted, RetryingHttp
from verst.rollout.protocols import RewardValue
from verst.rollout.sample import Sample


class RemoteRewardError(RuntimeError):
    """The remote reward model could not score a sample; the message says why and what to check."""


class RemoteRewardModel:
    """An async `RewardFn` that asks a reward server over HTTP.

    Its HTTP (one pooled session per event loop, bounded retries of retryable failures) is the
    engines' `RetryingHttp`; call `aclose()` when done.
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
        """`timeout_s`: total bound of one attempt; `max_retries`: retries after the first attempt
        of a retryable failure, the first after `backoff_s` (doubling)."""
        self.url = url
        """Endpoint receiving the POST."""
        self.settings = HttpSettings(
            max_connections=max_connections,
            timeout_s=timeout_s,
            connect_timeout_s=timeout_s,  # one bound for the whole attempt
            max_retries=max_retries,
            backoff_s=backoff_s,
        )
        self._http = RetryingHttp(self.settings)

    async def aclose(self) -> None:
        """Close the HTTP session."""
        await self._http.close()

    async def __call__(self, sample: Sample) -> RewardValue:
        payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
        return await self.score(payload)

    async def score(self, payload: dict[str, Any]) -> RewardValue:
        """POST one payload and parse the reward, retrying retryable failures."""
        try:
            data = await self._http.call("POST", self.url, payload)
        except HttpStatusError as exc:
            raise RemoteRewardError(
                f"reward server {self.url} rejected the request with HTTP {exc.status}: "
                f"{_text(exc.data)[:500]}; check that it accepts JSON {{prompt, response, label}}"
            ) from exc
        except RetriesExhausted as exc:
            raise RemoteRewardError(
                f"reward server {self.url} failed {exc.attempts} times (last: {exc.last}); "
                f"check that it is running and reachable, or raise rollout.reward.timeout_s"
            ) from exc
        except InvalidRequest as exc:  # a malformed URL
            raise RemoteRewardError(f"reward server {self.url}: {exc}; check rollout.reward.url") from exc
        return self._parse(data)

    def _parse(self, data: Any) -> RewardValue:
        if isinstance(data, str) or data is None:
            raise RemoteRewardError(
                f"reward server {self.url} answered non-JSON {(data or '')[:200]!r}; "
                f'it must answer {{"reward": <float>}} or a bare number'
            )
        value = data.get("reward") if isinstance(data, dict) else data
        if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
            raise RemoteRewardError(
                f"reward server {self.url} answered {_text(data)[:200]!r}; "
                f'it must answer {{"reward": <float or {{name: float}}>}} or a bare number'
            )
        if isinstance(value, dict):
            return {str(k): float(v) for k, v in value.items()}
        return float(value)


def _text(data: Any) -> str:
    """A decoded body as text again (for messages)."""
    return data if isinstance(data, str) else json.dumps(data)
