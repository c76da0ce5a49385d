"""Deterministic, real small parts for the legacy-rollout tests (no transformers import).

- `HoldingEngine`: an `InferenceEngine` whose tokens are a function of the prompt; a request
  chosen by `hold` emits a few tokens and then waits until it is aborted (by request-id
  prefix), returning its partial output with finish reason `abort` — the long tail that
  partial rollout exists for.
- `CharTokenizer`: one token per character, no special tokens.
- `legacy_context`: a `RolloutContext` over a real `PromptDataSource` (JSONL in a tmp dir).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verst.rollout.config import DataConfig, RolloutConfig
from verst.rollout.data import PromptDataSource
from verst.rollout.engine import GenerateOutput, GenerateRequest
from verst.rollout.lifecycle import EventKind, ListSink
from verst.rollout.protocols import RolloutContext
from verst.rollout.sample import Sample


class CharTokenizer:
    """`encode`/`decode` one character per token id (`ord(c) % 128`)."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 128 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def token_at(prompt_ids: list[int], position: int) -> int:
    """The token the engine emits at absolute `position` of a sequence starting with `prompt_ids`."""
    return 97 + (sum(prompt_ids[:4]) + position) % 26


class HoldingEngine:
    """See the module docstring. Tokens depend on the prompt and absolute position only, so a
    resumed request continues exactly where the aborted one stopped."""

    def __init__(self, *, hold: Callable[[GenerateRequest], int | None] = lambda r: None) -> None:
        self.hold = hold
        """`request → k`: emit k tokens, then wait for abort; None = generate to max_new_tokens."""
        self.weight_version = 0
        """Reported with every output."""
        self.requests: list[GenerateRequest] = []
        """Every request received, in order."""
        self.abort_calls: list[str | None] = []
        """Every abort prefix received."""
        self._held: dict[str, asyncio.Event] = {}

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.requests.append(request)
        start = len(request.input_ids)
        n = request.sampling.max_new_tokens
        k = self.hold(request)
        finish = "length"
        if k is not None and k < n:
            event = self._held.setdefault(request.rid, asyncio.Event())
            try:
                await event.wait()
            finally:
                self._held.pop(request.rid, None)
            n, finish = k, "abort"
        ids = [token_at(request.input_ids, start + i) for i in range(n)]
        return GenerateOutput(
            output_ids=ids,
            output_logprobs=[-0.01 * (start + i) for i in range(n)],
            finish_reason=finish,  # type: ignore[arg-type]
            weight_version=self.weight_version,
            prompt_tokens=start,
        )

    async def abort(self, rid_prefix: str | None = None) -> None:
        self.abort_calls.append(rid_prefix)
        for rid, event in list(self._held.items()):
            if rid_prefix is None or rid.startswith(rid_prefix):
                event.set()

    async def update_weights_from_tensors(
        self, named_tensors: dict[str, Any], weight_version: int | None = None
    ) -> int:
        self.weight_version = self.weight_version + 1 if weight_version is None else weight_version
        return self.weight_version

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> int:
        return await self.update_weights_from_tensors({}, weight_version)

    async def health(self) -> bool:
        return True

    async def get_weight_version(self) -> int:
        return self.weight_version

    async def close(self) -> None:
        pass


async def first_letter_reward(sample: Sample) -> float:
    """1.0 when the response starts with the label's letter."""
    return float(bool(sample.response) and sample.response[0] == str(sample.label))


def write_prompts(path: Path, prompts: list[str], labels: list[str] | None = None) -> Path:
    """A JSONL prompt file."""
    labels = labels or ["a"] * len(prompts)
    rows = (json.dumps({"prompt": p, "label": label}) for p, label in zip(prompts, labels, strict=True))
    path.write_text("".join(row + "\n" for row in rows))
    return path


def legacy_context(
    tmp_path: Path,
    engine: Any,
    prompts: list[str],
    *,
    tokenizer: Any = None,
    env: dict[str, str] | None = None,
    **config: Any,
) -> RolloutContext:
    """A context over `engine`, a real `PromptDataSource` (no shuffle) and a `ListSink`."""
    data = DataConfig(path=str(write_prompts(tmp_path / "prompts.jsonl", prompts)), shuffle=False)
    cfg = RolloutConfig(**{"batch_size": 2, "n_samples_per_prompt": 2, "data": data, **config})
    return RolloutContext(
        config=cfg,
        data_source=PromptDataSource(data, cfg.n_samples_per_prompt),
        engine=engine,
        tokenizer=tokenizer if tokenizer is not None else CharTokenizer(),
        reward_fn=first_letter_reward,
        sink=ListSink(),
        env=env or {},
    )


def assert_complete_streams(sink: ListSink) -> int:
    """Every attempt_start is followed, for the same sample, by exactly one attempt_end before the
    next attempt_start, and gen_start/gen_end sit inside an attempt. Returns the attempt count."""
    per_sample: dict[tuple[int, int | None], list[str]] = {}
    for e in sink.events:
        per_sample.setdefault((e.rollout_id, e.sample_index), []).append(e.kind.value)
    attempts = 0
    for key, kinds in per_sample.items():
        open_ = False
        for k in kinds:
            if k == EventKind.ATTEMPT_START:
                assert not open_, f"{key}: attempt_start inside an open attempt: {kinds}"
                open_, attempts = True, attempts + 1
            elif k == EventKind.ATTEMPT_END:
                assert open_, f"{key}: attempt_end without attempt_start: {kinds}"
                open_ = False
            else:
                assert open_, f"{key}: {k} outside an attempt: {kinds}"
        assert not open_, f"{key}: attempt never ended: {kinds}"
    return attempts
