"""A sequence-classification reward model (`rollout.reward.type = "reward_model"`).

`rollout.reward.reward_model.path` is a transformers `AutoModelForSequenceClassification`
checkpoint. Each sample's `prompt + response` is scored: with one label, the score is its logit;
with `label_index` set, the softmax probability of that label. Samples that finish close together
are scored in one padded forward (up to `batch_size`, waiting at most `batch_wait_ms` for more),
on `device`, in a worker thread so the event loop keeps generating; a batch gives the same scores
as one-by-one scoring (the attention mask hides the padding). A failing forward raises
`RewardModelError` for each sample of its batch, counted as reward errors. Needs the `local` extra.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

from verst.rollout.sample import Sample

if TYPE_CHECKING:
    from verst.rollout.config import RewardModelConfig


class RewardModelError(RuntimeError):
    """The reward model could not score a batch; the message says why."""


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in value)
    return str(value)


class RewardModelReward:
    """An async `RewardFn` batching (prompt, response) pairs into a sequence-classification model."""

    def __init__(self, config: RewardModelConfig, model: Any = None, tokenizer: Any = None) -> None:
        """`model` / `tokenizer`: already loaded ones (None = load `config.path` on first use)."""
        self.config = config
        """The reward-model section."""
        self._model, self._tokenizer = model, tokenizer
        self._lock = threading.Lock()
        self._queue: list[tuple[str, asyncio.Future[float]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self.batches = 0
        """Forwards run (for tests and metrics)."""

    def _load(self) -> tuple[Any, Any]:
        if self._model is None:
            if not self.config.path:
                raise RewardModelError("rollout.reward.reward_model.path is not set")
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            self._tokenizer = self._tokenizer or AutoTokenizer.from_pretrained(self.config.path)
            model = AutoModelForSequenceClassification.from_pretrained(self.config.path)
            self._model = model.to(self.config.device).eval()
        tok = self._tokenizer
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        if getattr(self._model.config, "pad_token_id", None) is None:
            self._model.config.pad_token_id = tok.pad_token_id
        return self._model, tok

    def score_texts(self, texts: list[str]) -> list[float]:
        """Scores of `texts` in one padded forward (blocking; thread-safe)."""
        import torch

        with self._lock:
            model, tok = self._load()
            tok.padding_side, tok.truncation_side = "right", "left"
            enc = tok(
                texts, padding=True, truncation=True, max_length=self.config.max_length, return_tensors="pt"
            )
            enc = {k: v.to(model.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
            with torch.no_grad():
                logits = model(**enc).logits.float()
            self.batches += 1
        if self.config.label_index is None:
            if logits.shape[-1] != 1:
                raise RewardModelError(
                    f"the reward model has {logits.shape[-1]} labels; set "
                    f"rollout.reward.reward_model.label_index to the one that means 'good'"
                )
            return logits[:, 0].tolist()
        return torch.softmax(logits, dim=-1)[:, self.config.label_index].tolist()

    async def __call__(self, sample: Sample) -> float:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[float] = loop.create_future()
        self._queue.append((_text(sample.prompt) + sample.response, fut))
        if len(self._queue) >= self.config.batch_size:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.config.batch_wait_ms / 1000, self._flush)
        return await fut

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._queue:
            batch, self._queue = self._queue[: self.config.batch_size], self._queue[self.config.batch_size :]
            task = asyncio.ensure_future(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[str, asyncio.Future[float]]]) -> None:
        try:
            scores = await asyncio.to_thread(self.score_texts, [t for t, _ in batch])
        except Exception as exc:
            err = (
                exc
                if isinstance(exc, RewardModelError)
                else RewardModelError(f"reward model {self.config.path}: {type(exc).__name__}: {exc}")
            )
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(err)
            return
        for (_, fut), score in zip(batch, scores, strict=True):
            if not fut.done():
                fut.set_result(float(score))
