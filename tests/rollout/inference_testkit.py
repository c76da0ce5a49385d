"""Small, deterministic, real components for the rollout-strategy tests.

- `ToyEngine`: an `InferenceEngine` that "decodes" deterministic tokens, optionally one per
  `token_delay_s` (so aborts land mid-generation), honours `max_new_tokens`, abort by request
  id prefix (partial output, finish reason `abort`) and can inject faults (`fail`).
- `ListDataSource`: a `DataSource` over a list of prompts, with the hand-back buffer.
- `ByteTokenizer`: encode/decode/chat template without transformers (fast to import).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from verst.rollout.config import RolloutConfig
from verst.rollout.engine import GenerateOutput, GenerateRequest
from verst.rollout.lifecycle import EventKind, ListSink
from verst.rollout.protocols import GenerateInput, RolloutContext
from verst.rollout.sample import Sample, Status


class ByteTokenizer:
    """One token per character (`ord(c) % 128`); `apply_chat_template` joins user contents."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 128 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False, **kw: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def default_length(request: GenerateRequest) -> int:
    """Response length (tokens) the toy engine aims for: 2..6, a function of the prompt."""
    return 2 + sum(request.input_ids) % 5


class FakeEngineBase:
    """What the test engines share: a weight version, aborts that set each running request's
    event (`_running`, by rid), weight updates that only bump the version."""

    def __init__(self, weight_version: int = 0) -> None:
        self.weight_version = weight_version
        self.abort_calls: list[str | None] = []
        """Every abort prefix received."""
        self._running: dict[str, asyncio.Event] = {}

    async def abort(self, rid_prefix: str | None = None) -> None:
        self.abort_calls.append(rid_prefix)
        for rid, event in list(self._running.items()):
            if rid_prefix is None or rid.startswith(rid_prefix):
                event.set()

    async def update_weights_from_tensors(
        self, named_tensors: dict[str, Any], weight_version: int | None = None
    ) -> int:
        self.weight_version = weight_version if weight_version is not None else self.weight_version + 1
        return self.weight_version

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> int:
        return await self.update_weights_from_tensors({}, weight_version)

    async def health(self) -> bool:
        return True

    async def get_weight_version(self) -> int:
        return self.weight_version

    async def close(self) -> None:
        pass


class ToyEngine(FakeEngineBase):
    """A deterministic in-process `InferenceEngine` (see the module docstring)."""

    def __init__(
        self,
        *,
        length: Callable[[GenerateRequest], int] = default_length,
        token_delay_s: float | Callable[[GenerateRequest], float] = 0.0,
        fail: Callable[[GenerateRequest], BaseException | None] | None = None,
        weight_version: int = 0,
    ) -> None:
        super().__init__(weight_version)
        self.length = length
        self.token_delay_s = token_delay_s
        self.fail = fail
        self.requests: list[GenerateRequest] = []
        """Every request received, in order."""

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.requests.append(request)
        if self.fail is not None:
            exc = self.fail(request)
            if exc is not None:
                raise exc
        target = self.length(request)
        n = min(target, request.sampling.max_new_tokens)
        delay = self.token_delay_s(request) if callable(self.token_delay_s) else self.token_delay_s
        base = sum(request.input_ids) + len(request.input_ids)
        ids: list[int] = []
        finish = "stop" if n == target else "length"
        if delay <= 0:
            ids = [(base + i) % 20 + 65 for i in range(n)]
        else:
            aborted = self._running.setdefault(request.rid, asyncio.Event())
            try:
                for i in range(n):
                    try:
                        await asyncio.wait_for(aborted.wait(), delay)
                    except TimeoutError:
                        ids.append((base + i) % 20 + 65)
                        continue
                    finish = "abort"
                    break
            finally:
                self._running.pop(request.rid, None)
        return GenerateOutput(
            output_ids=ids,
            output_logprobs=[-0.1 * (i + 1) for i in range(len(ids))],
            finish_reason=finish,  # type: ignore[arg-type]
            weight_version=self.weight_version,
            prompt_tokens=len(request.input_ids),
            text="".join(chr(i) for i in ids),
        )


class ListDataSource:
    """A `DataSource` over prompts (served once, in order, then exhausted); a buffer for hand-backs."""

    def __init__(
        self, prompts: list[str], n_samples_per_prompt: int, labels: list[Any] | None = None
    ) -> None:
        self.prompts = prompts
        self.labels = labels or [None] * len(prompts)
        self.n = n_samples_per_prompt
        self.offset = 0
        self.buffer: deque[list[Sample]] = deque()
        self.served_groups = 0
        self.returned_groups = 0

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        out = []
        while self.buffer and len(out) < num_groups:
            out.append(self.buffer.popleft())
        while len(out) < num_groups and self.offset < len(self.prompts):
            i = self.offset
            self.offset += 1
            proto = Sample(prompt=self.prompts[i], label=self.labels[i], metadata={"prompt_id": i})
            out.append([proto.clone() for _ in range(self.n)])
        self.served_groups += len(out)
        return out

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.returned_groups += len(groups)
        self.buffer.extend(groups)

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset, "buffer": [[s.to_dict() for s in g] for g in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offset = state["offset"]
        self.buffer = deque([[Sample.from_dict(d) for d in g] for g in state["buffer"]])


async def length_reward(sample: Sample) -> float:
    """A rule reward: 1 if the response has an even number of tokens."""
    return float(sample.response_length % 2 == 0)


def make_context(
    engine: Any = None,
    *,
    prompts: list[str] | None = None,
    reward_fn: Any = length_reward,
    **config: Any,
) -> RolloutContext:
    """A context over a `ToyEngine`, a `ListDataSource` of `prompts` and a `ListSink`."""
    cfg = RolloutConfig(**{"batch_size": 2, "n_samples_per_prompt": 2, **config})
    prompts = prompts if prompts is not None else [f"prompt {i}" for i in range(32)]
    return RolloutContext(
        config=cfg,
        data_source=ListDataSource(prompts, cfg.n_samples_per_prompt),
        engine=engine if engine is not None else ToyEngine(),
        tokenizer=ByteTokenizer(),
        reward_fn=reward_fn,
        sink=ListSink(),
    )


def attempt_streams(sink: ListSink) -> dict[int | None, list[str]]:
    """Event kinds per sample index, in emission order."""
    out: dict[int | None, list[str]] = {}
    for e in sink.events:
        out.setdefault(e.sample_index, []).append(e.kind.value)
    return out


def assert_attempts_closed(sink: ListSink) -> None:
    """Every attempt_start has exactly one attempt_end after it (per sample, in order)."""
    for idx, kinds in attempt_streams(sink).items():
        depth = 0
        for k in kinds:
            if k == EventKind.ATTEMPT_START:
                assert depth == 0, f"sample {idx}: attempt started inside an open attempt: {kinds}"
                depth = 1
            elif k == EventKind.ATTEMPT_END:
                assert depth == 1, f"sample {idx}: attempt_end without attempt_start: {kinds}"
                depth = 0
            else:
                assert depth == 1, f"sample {idx}: {k} outside an attempt: {kinds}"
        assert depth == 0, f"sample {idx}: attempt never closed: {kinds}"


class EchoGenerate:
    """A new-style generate function class: answers with the prompt reversed (no engine)."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, inp: GenerateInput) -> Sample:
        self.calls += 1
        s = inp.sample
        s.tokens = [1, 2, 3, 4]
        s.response_length = 2
        s.response = str(s.prompt)[::-1]
        s.status = Status.COMPLETED
        s.metadata["generated_by"] = "echo"
        return s


async def v1_style_echo(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """A v1-signature generate function (no engine): records what it was given."""
    sample.tokens = [5, 6, 7]
    sample.response_length = 1
    sample.response = "v1"
    sample.status = Status.COMPLETED
    sample.metadata["v1_max_new_tokens"] = sampling_params["max_new_tokens"]
    sample.metadata["v1_n"] = args.n_samples_per_prompt
    return sample
