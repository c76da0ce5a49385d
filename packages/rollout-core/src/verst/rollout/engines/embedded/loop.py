"""The embedded engine's worker thread: the decode loop and the hand-off of results to the
event loop that asked for them.

One thread owns the model. `DecodeLoopMixin._run` waits for work, applies aborts and commands
(weight updates, memory) between steps, collects companions of an idle engine's first request
(`_take_new`), admits queued requests into the `DecodeBatch`, steps it, and delivers finished
rows; a failed forward fails the rows it concerned (`_guarded`), never leaves them hanging.
`Handle` is one request's way back: its future (or stream queue) on its own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verst.rollout.engine import EngineError, GenerateOutput
from verst.rollout.engines.embedded.vision import unreadable_image
from verst.rollout.openmp import release_openmp_workers


@dataclass(slots=True)
class Handle:
    """Where a finished (or streamed) request is delivered, on its caller's event loop."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerateOutput]
    stream: asyncio.Queue[tuple[GenerateOutput, bool]] | None = None


def deliver(handle: Handle, out: GenerateOutput, *, final: bool) -> None:
    def put() -> None:
        if handle.stream is not None:
            handle.stream.put_nowait((out, final))
        if final and not handle.future.done():
            handle.future.set_result(out)

    with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
        handle.loop.call_soon_threadsafe(put)


def deliver_final(items: list[tuple[Handle, GenerateOutput]]) -> None:
    """Deliver finished outputs with one wake-up per caller loop (not one per request)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Handle, GenerateOutput]]] = {}
    for handle, out in items:
        by_loop.setdefault(handle.loop, []).append((handle, out))

    def put(batch: list[tuple[Handle, GenerateOutput]]) -> None:
        for handle, out in batch:
            if handle.stream is not None:
                handle.stream.put_nowait((out, True))
            if not handle.future.done():
                handle.future.set_result(out)

    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
            loop.call_soon_threadsafe(put, batch)


def fail(handle: Handle, exc: BaseException) -> None:
    def put() -> None:
        if not handle.future.done():
            handle.future.set_exception(exc)
        if handle.stream is not None:
            handle.stream.put_nowait((GenerateOutput([], [], "abort", 0), True))

    with contextlib.suppress(RuntimeError):
        handle.loop.call_soon_threadsafe(put)


class DecodeLoopMixin:
    """The worker-thread half of `EmbeddedEngine` (its state is set up by the engine)."""

    BATCH_WAIT_CAP: float
    IDLE_RELEASE_S: float
    batch_wait_s: float
    max_batch_size: int
    context_len: int
    peak_batch: int
    released: Any
    tokenizer: Any
    _weight_version: int
    _cond: Any
    _batch: Any
    _pending: list[Any]
    _commands: list[Any]
    _aborts: list[Any]
    _cancelled: list[Any]
    _paused: bool
    _closed: bool
    missing_adapter_error: Callable[[str | None], BaseException | None]
    _resume_now: Callable[[], int]

    def _output(self, r: Any) -> GenerateOutput:
        req = r.request
        text = ""
        if self.tokenizer is not None and r.output_ids:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=False)
        return GenerateOutput(
            output_ids=list(r.output_ids),
            output_logprobs=list(r.output_logprobs) if req.return_logprob else [],
            finish_reason=r.finish or "abort",
            weight_version=self._weight_version,
            prompt_tokens=r.prompt_len,
            text=text,
            input_logprobs=r.input_logprobs,
            output_top_logprobs=list(r.output_top) if req.top_logprobs_num else None,
            input_top_logprobs=r.input_top,
            output_token_ids_logprobs=list(r.output_ids_lp) if req.token_ids_logprob else None,
            input_token_ids_logprobs=r.input_ids_lp,
            routed_experts=_routed_experts(r) if req.return_routed_experts else None,
        )

    def _emit(self, r: Any) -> None:
        deliver(r.handle, self._output(r), final=True)

    def _emit_all(self, rows: list[Any]) -> None:
        if rows:
            deliver_final([(r.handle, self._output(r)) for r in rows])

    def _has_work(self) -> bool:
        return bool(
            self._commands
            or self._aborts
            or self._cancelled
            or (not self._paused and (self._pending or len(self._batch)))
        )

    def _drop_cancelled(self) -> None:
        """Remove the rows whose caller stopped waiting (`_cancel`): queued ones leave the queue,
        running ones end as aborted at this step. Called with `_cond` held."""
        if not self._cancelled:
            return
        gone = {id(r) for r in self._cancelled}
        self._cancelled = []
        self._pending = [r for r in self._pending if id(r) not in gone]
        self._batch.mark_abort(lambda r: id(r) in gone)

    def _take_new(self) -> list[Any]:
        """Queued requests that fit the batch; an idle engine first collects companions.

        It waits until `batch_wait_s` passes without a new arrival (a rollout submitting its
        requests one by one keeps extending the wait, so they share one prefill), the batch is
        full, or `BATCH_WAIT_CAP × batch_wait_s` has passed in total.
        """
        with self._cond:
            if not len(self._batch) and self._pending and self.batch_wait_s > 0:
                now = time.monotonic()
                deadline, cap = now + self.batch_wait_s, now + self.BATCH_WAIT_CAP * self.batch_wait_s
                seen = len(self._pending)
                while len(self._pending) < self.max_batch_size and not self._closed:
                    left = min(deadline, cap) - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                    if len(self._pending) > seen:  # companions still arriving
                        seen = len(self._pending)
                        deadline = time.monotonic() + self.batch_wait_s
            room = self.max_batch_size - len(self._batch)
            new, self._pending = self._pending[:room], self._pending[room:]
            return new

    def _run(self) -> None:
        import torch

        with torch.inference_mode():
            while True:
                with self._cond:
                    if not self._closed and not self._has_work():
                        self._cond.wait(self.IDLE_RELEASE_S)
                        if not self._closed and not self._has_work():
                            release_openmp_workers()  # idle: let the trainer's kernels spin (`openmp`)
                    while not self._closed and not self._has_work():
                        self._cond.wait()
                    if self._closed:
                        break
                    commands, self._commands = self._commands, []
                    aborts, self._aborts = self._aborts, []
                    self._drop_cancelled()
                for match, _ in aborts:
                    self._batch.mark_abort(match)
                for fn, fut in commands:
                    try:
                        fut.set_result(fn())
                    except Exception as exc:
                        fut.set_exception(exc)
                self._emit_all(self._batch.pop_finished())
                for _, ack in aborts:
                    ack.set_result(None)
                if self._paused:
                    continue
                if self.released and self._pending:
                    self._resume_now()
                self._admit(self._take_new())
                self._emit_all(self._batch.pop_finished())
                if len(self._batch):
                    self.peak_batch = max(self.peak_batch, len(self._batch))
                    self._guarded(self._batch.step, self._batch.rows)
                for r in self._batch.rows:
                    if r.handle.stream is not None and r.finish is None:
                        deliver(r.handle, self._output(r), final=False)
                self._emit_all(self._batch.pop_finished())
        self._shutdown()

    def _admit(self, new: list[Any]) -> None:
        generate = []
        for r in new:
            missing = self.missing_adapter_error(r.request.lora_path)  # at admission: a refit may swap it
            bad_image = None if missing is not None else unreadable_image(self._batch.vision, r.request.images)
            if missing is not None:
                fail(r.handle, missing)
            elif bad_image is not None:
                fail(r.handle, EngineError(f"embedded engine: {bad_image}"))
            elif r.request.sampling.max_new_tokens == 0:
                self._guarded(lambda r=r: self._batch.score(r), [r])
                if r.finish is not None:
                    self._emit(r)
            elif r.prompt_len >= self.context_len:
                r.finish = "length"
                self._emit(r)
            else:
                generate.append(r)
        if generate:
            self._guarded(lambda: self._batch.admit(generate), generate)

    def _guarded(self, fn: Callable[[], None], rows: list[Any]) -> None:
        """Run a forward; on failure, fail the affected requests (never leave them hanging)."""
        try:
            fn()
        except Exception as exc:
            error = EngineError(f"embedded engine forward failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            failed = {id(r) for r in rows}
            for r in list(rows):
                fail(r.handle, error)
            if any(id(r) in failed for r in self._batch.rows):
                self._batch.drop_all("abort")

    def _shutdown(self) -> None:
        with self._cond:
            aborts, self._aborts = self._aborts, []
            commands, self._commands = self._commands, []
            self._drop_cancelled()
            pending, self._pending = self._pending, []
        rows = [*pending, *self._batch.drop_all("abort")]
        for r in rows:
            r.finish = r.finish or "abort"
        self._emit_all(rows)
        for _, ack in aborts:
            ack.set_result(None)
        for _, fut in commands:
            fut.set_exception(EngineError("the embedded engine was closed before the weight update ran"))


def _routed_experts(r: Any) -> Any:
    """Rows `[routed_experts_start_len, prompt + output - 1)` of a row's recorded routing
    (SGLang's range); None for a dense model or a row that never ran a forward."""
    import torch

    from verst.rollout.moe import RoutedExperts

    if not r.routing:
        return None
    rows = torch.cat(r.routing)[: r.prompt_len + len(r.output_ids) - 1]  # [positions, layers × k]
    return RoutedExperts.from_tensor(rows[max(0, r.request.routed_experts_start_len) :])
