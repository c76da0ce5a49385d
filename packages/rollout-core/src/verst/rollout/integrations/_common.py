"""Pieces the ecosystem adapters share: the failure type, tool-call reading, list data sources."""

from __future__ import annotations

import random
from typing import Any

from verst.rollout.config import DataConfig
from verst.rollout.data import PromptDataSource, check_group_size
from verst.rollout.data_sources import GeneratedSource
from verst.rollout.sample import Sample


class EnvFailure(RuntimeError):
    """An environment failed (it raised, its server answered an error or timed out, or it sent a
    malformed message). Raised out of `reset`/`step`: the rollout records it on the samples
    (`metadata["error"]`), retries the group up to `rollout.max_group_retries`, then marks it
    FAILED and counts it (`rollout/failed_groups`); the run goes on."""

    def __init__(self, ecosystem: str, reason: str, message: str) -> None:
        super().__init__(f"{ecosystem} environment failed ({reason}): {message}")
        self.ecosystem = ecosystem
        """Which adapter: verifiers, openenv, nemo_gym."""
        self.reason = reason
        """One of: exception, http_error, timeout, malformed."""


def assistant_message(text: str, tools: list[dict[str, Any]] | None, parse_tools: bool) -> dict[str, Any]:
    """A model turn's text as an OpenAI assistant message (tool calls parsed as `verst serve`
    does with `--tool-call-parser hermes`, when `parse_tools` and tools are offered)."""
    from verst.rollout.engines.serve.openai_protocol import parse_tool_calls
    from verst.rollout.rewards.rules import strip_trailing_stop

    text = strip_trailing_stop(text)
    calls: list[dict[str, Any]] = []
    if parse_tools and tools:
        text, calls = parse_tool_calls(text, tools)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return message


class ListSource(PromptDataSource):
    """A `PromptDataSource` over samples an adapter loaded (its dataset), with the same epochs,
    shuffling, hand-back buffer and exact resume."""

    def __init__(self, samples: list[Sample], n_samples_per_prompt: int, *, shuffle: bool, seed: int) -> None:
        check_group_size(n_samples_per_prompt)
        if not samples:
            raise ValueError("the environment's dataset has no rows")
        self._serve(DataConfig(shuffle=shuffle, seed=seed), samples, n_samples_per_prompt)

    def samples(self) -> list[Sample]:
        """Every sample (an eval set), shuffled with the seed when `shuffle`."""
        out = list(self._prompts)
        if self.config.shuffle:
            random.Random(self.config.seed).shuffle(out)
        return out


class LoadedSource(GeneratedSource, ListSource):
    """A generated source whose rows the adapter reads at once (`_rows()`), then served as a
    `ListSource`: shuffled each epoch with `options.seed` when `_shuffles()`."""

    def _start(self) -> None:
        rows = self._rows()
        ListSource.__init__(
            self, rows, self.n_samples_per_prompt, shuffle=self._shuffles(), seed=self.options.seed
        )

    def _rows(self) -> list[Sample]:
        """Every row of the source as a PENDING sample."""
        raise NotImplementedError(f"{type(self).__name__}._rows")

    def _shuffles(self) -> bool:
        """Whether epochs are shuffled (`options.shuffle`)."""
        return bool(self.options.shuffle)
