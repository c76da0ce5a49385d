"""What a run records for `verst dashboard`: `samples.jsonl`, `status.json`, and Ray event relay.

`RunRecorder` (driver / rank 0 only) writes

* `samples.jsonl` — one line per sample of every training rollout and evaluation: previews of
  the prompt, response, label and error (the shared `sample_text_preview` helper bounds each),
  the reward (a dict reward keeps at most `MAX_REWARD_KEYS` entries), status, lengths, weight
  versions. At most `MAX_SAMPLES_PER_STEP` samples per step and split are written, so a line is
  a few KiB at most and a step's lines are bounded whatever the response lengths.
* `trajectories.jsonl` — the full trajectory (every token id and its text, loss mask, engine
  and trainer log-probs, advantages, weight versions, segments, MoE routing) of the
  `trajectories_per_step` lowest sample indices of each step and split and of every failed or
  aborted sample (`verst.trainer.run.trajectories` holds the format,
  `verst.trainer.dashboard.trajectories` the reader).
* `status.json` — replaced atomically on every phase change: state (`running`, `finished`,
  `stopped_early`, `failed` with the error), the current phase and step, seconds per phase,
  the ETA, the pid and host (so a reader can tell a live run from one that died).

`BufferedSink` is the lifecycle sink of the Ray rollout manager: events stay in the actor's
memory until the driver drains them after each call (`RolloutProxy`), and the driver writes
them to its own `lifecycle.jsonl` — so events reach the driver's run directory without a
shared filesystem.

Step numbering: the rollout with `rollout_id = r` trains step `r + 1` (the step `metrics.jsonl`
logs it under); samples carry both.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verst.rollout.lifecycle import LifecycleEvent
from verst.rollout.logging_utils import sample_text_preview
from verst.rollout.protocols import RolloutResult
from verst.rollout.sample import Sample
from verst.trainer.run.trajectories import (
    TRAJECTORIES_FILE,
    Decode,
    StepDetail,
    TokenDetail,
    choose_trajectories,
    record_key,
    trajectory_record,
    write_lines,
)

if TYPE_CHECKING:  # torch-free at run time: `verst dashboard` imports this module
    from verst.trainer.train.batch import TrainBatch
    from verst.trainer.train.step_detail import StepRowDetail

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
"""Per-sample previews and outcomes, in the run directory."""
STATUS_FILE = "status.json"
"""The run's state, phase, step and phase times, in the run directory."""
PROMPT_PREVIEW = 600
"""Characters of prompt kept (head and tail around an omission marker)."""
RESPONSE_PREVIEW = 1200
"""Characters of response kept."""
TEXT_PREVIEW = 300
"""Characters of label / error kept."""
MAX_REWARD_KEYS = 32
"""Entries of a dict reward kept."""
MAX_WEIGHT_VERSIONS = 16
"""Weight versions kept per sample (the newest)."""
MAX_SAMPLES_PER_STEP = 4096
"""Samples written per step and split; the rest are counted in `status.json` (`samples_dropped`)."""
MAX_BUFFERED_EVENTS = 1_000_000
"""Events a `BufferedSink` holds between drains; older ones are dropped (and counted)."""
STATUS_INTERVAL_S = 0.5
"""Phase changes and finished steps closer together than this reach `status.json` together (a
tiny run changes phase every few ms; the dashboard polls every few seconds)."""


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # chat messages
        return "\n".join(
            f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, Mapping) else str(m)
            for m in prompt
        )
    return str(prompt)


def _reward(reward: Any) -> Any:
    if isinstance(reward, Mapping):
        items = list(reward.items())[:MAX_REWARD_KEYS]
        return {sample_text_preview(str(k), 64): _scalar(v) for k, v in items}
    return _scalar(reward)


def _scalar(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value if not isinstance(value, str) else sample_text_preview(value, 64)
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    try:
        return float(value)
    except (TypeError, ValueError):
        return sample_text_preview(repr(value), 64)


def sample_record(
    sample: Sample, *, step: int, rollout_id: int | None, split: str, advantage: float | None = None
) -> dict[str, Any]:
    """The bounded `samples.jsonl` line of one sample (`step` first, so readers can index cheaply);
    `advantage`: the mean advantage over its trained tokens (None: not trained on)."""
    error = sample.metadata.get("error")
    return {
        **record_key(sample, step=step, rollout_id=rollout_id, split=split),
        "status": sample.status.value,
        "reward": _reward(sample.reward),
        "advantage": _scalar(advantage) if advantage is not None else None,
        "prompt": sample_text_preview(_prompt_text(sample.prompt), PROMPT_PREVIEW),
        "response": sample_text_preview(sample.response, RESPONSE_PREVIEW),
        "label": None if sample.label is None else sample_text_preview(str(sample.label), TEXT_PREVIEW),
        "prompt_tokens": sample.prompt_length,
        "response_tokens": sample.response_length,
        "weight_versions": list(sample.weight_versions[-MAX_WEIGHT_VERSIONS:]),
        "attempt": sample.metadata.get("attempt"),
        "error": None if error is None else sample_text_preview(str(error), TEXT_PREVIEW),
    }


def lazy_decoder(load_tokenizer: Callable[[], Any]) -> Decode:
    """Token ids -> the text of each id alone, with the tokenizer `load_tokenizer` gives on first
    use (a tokenizer that cannot be loaded leaves `token_text` null, with one warning).

    Each id's text is decoded once and remembered (an id alone always decodes the same): the
    trajectories of a step repeat the same prompt and answer tokens, and the tokenizer's
    per-call cost dominated recording at small scale."""
    held: list[Any] = []
    texts: dict[int, str] = {}  # at most the vocabulary

    def decode(ids: Sequence[int]) -> list[str] | None:
        if not held:
            try:
                held.append(load_tokenizer())
            except Exception as exc:  # the recording must never stop the run
                logger.warning("trajectories are recorded without token text: no tokenizer (%s)", exc)
                held.append(None)
        if held[0] is None:
            return None
        keys = [int(i) for i in ids]
        new = list(dict.fromkeys(k for k in keys if k not in texts))
        if new:
            decoded = held[0].batch_decode([[k] for k in new], clean_up_tokenization_spaces=False)
            texts.update(zip(new, decoded, strict=True))
        return [texts[k] for k in keys]

    return decode


def keyed_detail(rows: StepRowDetail | None, batch: TrainBatch) -> StepDetail:
    """A train step's per-row values keyed by (group_index, sample_index) instead of batch row."""
    if rows is None:
        return StepDetail()
    keys = batch.sample_keys
    return StepDetail(
        advantages={keys[r]: v for r, v in enumerate(rows.sample_advantages) if r < len(keys)},
        tokens={
            keys[r]: TokenDetail(rows.advantages.get(r), rows.trainer_logprobs.get(r))
            for r in set(rows.advantages) | set(rows.trainer_logprobs)
            if r < len(keys)
        },
    )


class RunRecorder:
    """Writes `samples.jsonl`, `trajectories.jsonl` and `status.json` for one run (create it on the
    main rank only).

    `trajectories_per_step`, `failed_trajectories`, `max_tokens`: which samples get their full
    trajectory recorded (`run.record`); `decode`: token ids -> one string each (None: no text);
    `status_interval_s`: see `StatusFile`."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int,
        start_step: int = 0,
        trajectories_per_step: int = 8,
        failed_trajectories: bool = True,
        max_tokens: int = 16384,
        decode: Decode | None = None,
        status_interval_s: float = STATUS_INTERVAL_S,
    ) -> None:
        self.root = Path(run_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self._samples = (self.root / SAMPLES_FILE).open("a", encoding="utf-8")
        self._trajectories = (self.root / TRAJECTORIES_FILE).open("a", encoding="utf-8")
        self.trajectories_per_step = trajectories_per_step
        self.failed_trajectories = failed_trajectories
        self.max_tokens = max_tokens
        self.decode = decode
        self.trajectories_written = 0
        self._lock = threading.Lock()
        self.total_steps = total_steps
        self.step = start_step
        self._start_step = start_step
        self.phase_name = "start"
        self._phase_since = time.monotonic()
        self.phase_seconds: dict[str, float] = {}
        """Wall seconds per phase (rollout, train, sync, eval, checkpoint) in this process."""
        self._first_rollout: float | None = None
        self.samples_written = 0
        self.samples_dropped = 0
        self.started_at = time.time()
        self.state = "running"
        self.error: str | None = None
        self._status_file = StatusFile(self.root / STATUS_FILE, self.status, status_interval_s)
        """Writes `status.json`: phase changes and finished steps off the training thread."""
        self._status_file.write_now()

    # ---- samples

    def choose(self, samples: Iterable[Sample]) -> dict[tuple[Any, Any], str]:
        """(group_index, sample_index) -> reason of the samples whose full trajectory is recorded."""
        chosen = choose_trajectories(samples, self.trajectories_per_step)
        if not self.failed_trajectories:
            chosen = {k: r for k, r in chosen.items() if r == "sampled"}
        return chosen

    def record_rollout(
        self,
        rollout_id: int,
        result: RolloutResult,
        detail: StepDetail | None = None,
        chosen: Mapping[tuple[Any, Any], str] | None = None,
    ) -> None:
        """The training samples of rollout `rollout_id` (step `rollout_id + 1`), with what the
        train step measured for them (`detail`; None when it did not run). `chosen`: what
        `choose` returned for these samples, when the caller already asked."""
        samples = [s for g in result.groups for s in g]
        self._write_samples(samples, rollout_id + 1, rollout_id, "train", detail or StepDetail(), chosen)

    def record_eval(self, step: int, result: RolloutResult) -> None:
        """The samples of an evaluation at `step`, split `eval/<dataset>`."""
        for name, groups in result.eval.items():
            samples = [s for g in groups for s in g]
            self._write_samples(samples, step, None, f"eval/{name}", StepDetail())

    def _write_samples(
        self,
        samples: list[Sample],
        step: int,
        rollout_id: int | None,
        split: str,
        detail: StepDetail,
        chosen: Mapping[tuple[Any, Any], str] | None = None,
    ) -> None:
        lines, dropped = [], 0
        for sample in samples:
            if len(lines) >= MAX_SAMPLES_PER_STEP:
                dropped += 1
                continue
            key = (sample.group_index, sample.sample_index)
            record = sample_record(
                sample, step=step, rollout_id=rollout_id, split=split, advantage=detail.advantages.get(key)
            )
            lines.append(json.dumps(record, default=str, ensure_ascii=False) + "\n")
        chosen = self.choose(samples) if chosen is None else chosen
        full = []
        for s in samples:
            key = (s.group_index, s.sample_index)
            if key in chosen:
                full.append(
                    trajectory_record(
                        s,
                        step=step,
                        rollout_id=rollout_id,
                        split=split,
                        reason=chosen[key],
                        decode=self.decode,
                        detail=detail.tokens.get(key),
                        max_tokens=self.max_tokens,
                    )
                )
        with self._lock:
            if self._samples.closed:
                return
            self._samples.write("".join(lines))
            self._samples.flush()
            self.trajectories_written += write_lines(self._trajectories, full)
        self.samples_written += len(lines)
        self.samples_dropped += dropped

    # ---- status

    def phase(self, name: str) -> None:
        """The run entered a phase (`status.json` shows it within `status_interval_s`)."""
        now = time.monotonic()
        with self._lock:
            self.phase_seconds[self.phase_name] = self.phase_seconds.get(self.phase_name, 0.0) + (
                now - self._phase_since
            )
            self.phase_name, self._phase_since = name, now
        if name == "rollout" and self._first_rollout is None:
            self._first_rollout = now
        if name == "done":
            self._status_file.write_now()
        else:
            self._status_file.changed()

    def resumed_at(self, step: int) -> None:
        """The loop starts (or resumes) at `step`."""
        self.step = self._start_step = step
        self._status_file.write_now()

    def step_done(self, step: int) -> None:
        """Step `step` finished (its metrics were logged; `status.json` shows it within
        `status_interval_s`)."""
        self.step = step
        self._status_file.changed()

    def finish(self, *, stopped_early: bool) -> None:
        """The loop returned."""
        self.state = "stopped_early" if stopped_early else "finished"
        self.phase("done")

    def fail(self, exc: BaseException) -> None:
        """The run raised `exc` (KeyboardInterrupt counts as stopped early)."""
        if isinstance(exc, KeyboardInterrupt):
            self.state = "stopped_early"
        else:
            self.state = "failed"
            self.error = f"{type(exc).__name__}: {sample_text_preview(str(exc), 2000)}"
        self.phase("done")

    def eta_seconds(self) -> float | None:
        """Mean time per step since the first rollout, times the steps left (None before one step)."""
        done = self.step - self._start_step
        if done <= 0 or self._first_rollout is None:
            return None
        return (time.monotonic() - self._first_rollout) / done * max(0, self.total_steps - self.step)

    def status(self) -> dict[str, Any]:
        """The `status.json` object."""
        with self._lock:  # phase() may change them on another thread
            current = dict(self.phase_seconds)
            phase_name, since = self.phase_name, self._phase_since
        current[phase_name] = current.get(phase_name, 0.0) + time.monotonic() - since
        current.pop("start", None)
        current.pop("done", None)
        return {
            "state": self.state,
            "phase": phase_name,
            "step": self.step,
            "total_steps": self.total_steps,
            "phase_seconds": {k: round(v, 3) for k, v in current.items()},
            "eta_s": None if self.state != "running" else self.eta_seconds(),
            "error": self.error,
            "samples_written": self.samples_written,
            "samples_dropped": self.samples_dropped,
            "trajectories_written": self.trajectories_written,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": self.started_at,
            "updated_at": time.time(),
        }

    def close(self) -> None:
        self._status_file.close()
        with self._lock:
            self._samples.close()
            self._trajectories.close()


class StatusFile:
    """`status.json`, replaced atomically with what `render()` returns.

    `write_now` writes on the calling thread (the run's start, resume and end). `changed` only
    notes that the status changed: a background thread writes it, at most once every
    `interval_s` and always the latest status — a step of a tiny run changes phase three times
    in ~100 ms, and three file replacements on the training thread cost it ~1.5 ms of CPU and
    several ms of wall time on a busy disk, for a file the dashboard reads every few seconds."""

    def __init__(self, path: Path, render: Callable[[], dict[str, Any]], interval_s: float) -> None:
        self.path = path
        self._render = render
        self.interval_s = interval_s
        self._tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self._write_lock = threading.Lock()  # one writer of the temp file at a time
        self._cond = threading.Condition()
        self._pending = False
        self._closed = False
        self._idle = False
        """The thread waits for a change (woken by `changed`; between writes it is left to sleep,
        so a change does not wake it only to wait again, taking the GIL from the training thread)."""
        self._thread = threading.Thread(target=self._loop, name="verst-status", daemon=True)
        self._thread.start()

    def changed(self) -> None:
        """The status changed: written by the background thread within `interval_s`."""
        with self._cond:
            self._pending = True
            if self._idle:
                self._cond.notify()

    def write_now(self) -> None:
        """Write the status on this thread (and drop a pending background write)."""
        with self._cond:
            self._pending = False
        self._write()

    def close(self) -> None:
        """Write what is pending and stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._idle = True
                while not self._pending and not self._closed:
                    self._cond.wait()
                self._idle = False
                if not self._pending:  # closed, nothing left to write
                    return
                self._pending = False
            self._write()
            with self._cond:  # at most one write per interval; close() cuts the wait short
                self._cond.wait_for(lambda: self._closed, timeout=self.interval_s)

    def _write(self) -> None:
        with self._write_lock:
            try:
                self._tmp.write_text(
                    json.dumps(self._render(), indent=1, default=str) + "\n", encoding="utf-8"
                )
                os.replace(self._tmp, self.path)
            except OSError:  # a full disk must not take the run down; the dashboard shows stale status
                pass


class BufferedSink:
    """A lifecycle sink that keeps events until `drain` (the Ray rollout manager's sink)."""

    def __init__(self, maxlen: int = MAX_BUFFERED_EVENTS) -> None:
        self._events: deque[LifecycleEvent] = deque()
        self._maxlen = maxlen
        self._lock = threading.Lock()
        self.dropped = 0
        """Events dropped because the buffer was full."""

    def emit(self, event: LifecycleEvent) -> None:
        with self._lock:
            if len(self._events) >= self._maxlen:
                self._events.popleft()
                self.dropped += 1
            self._events.append(event)

    def drain(self) -> list[LifecycleEvent]:
        """The events emitted since the last drain, in order."""
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out

    def close(self) -> None:
        pass
