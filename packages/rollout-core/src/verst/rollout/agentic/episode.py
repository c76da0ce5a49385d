"""`AgenticGenerate`: the `GenerateFn` that runs one environment episode per sample.

One sample = one episode: the prompt (the environment's first observation), then model turns
and environment observations in order, each added with `append_turn` (model ids exactly as the
engine generated them, loss mask 1; observation ids tokenized once, loss mask 0).

Concurrency: the rollout semaphore (`rollout.max_concurrency`) is taken **per engine request**,
not per episode (`acquires_semaphore = True` tells `generate_and_rm` not to hold it), so
episodes waiting on a tool never block generation; `rollout.env.max_episodes_in_flight` bounds
episodes. Timeouts: `step_timeout_s` per reset/step, `episode_timeout_s` per episode (both end
the episode with termination `timeout`, keeping its turns).

Abort: when the rollout aborts (`state.aborted`, or the engine returns `abort`), the episode
stops with termination `aborted` and status ABORTED. `on_abort = "resume"` keeps its turns and
parks its live environment, so a resubmitted sample continues where it stopped (partial
rollout / fully-async); `"restart"` closes the environment and resets the sample to its prompt.
A parked environment lives in this process only: an episode resubmitted after a restart (or
evicted from the park) starts over from its prompt, counted as the env metric `resumes_lost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from verst.rollout.agentic.config import EnvConfig
from verst.rollout.agentic.environment import (
    EnvCallError,
    Environment,
    EnvironmentFactory,
    EnvSetup,
    ModelTurn,
    StepResult,
    TerminationReason,
)
from verst.rollout.agentic.images import expand_observation
from verst.rollout.agentic.render import as_observation, observation_ids, prompt_ids
from verst.rollout.agentic.tracing import EpisodeTrace, episode_trace
from verst.rollout.agentic.trajectory import append_turn, mask_turns_before, segments_of
from verst.rollout.engine import GenerateOutput, GenerateRequest
from verst.rollout.lifecycle import EventKind, LifecycleEvent, NoopSink
from verst.rollout.protocols import GenerateInput, GenerateState, RolloutContext
from verst.rollout.sample import EPISODE_METADATA_KEYS, Sample, Status

T = TypeVar("T")

STATE_KEY = "agentic"
"""`sample.metadata` key of the loop's own per-episode state (episode id, open turn)."""

METADATA_KEYS = EPISODE_METADATA_KEYS
"""Per-episode metadata keys, removed when a sample is reset to its prompt (`STATE_KEY` among them)."""

STATUS_BY_TERMINATION: dict[TerminationReason, Status] = {
    TerminationReason.STOP: Status.COMPLETED,
    TerminationReason.ENV_DONE: Status.COMPLETED,
    TerminationReason.TOOL_ERROR: Status.COMPLETED,
    TerminationReason.MAX_TURNS: Status.TRUNCATED,
    TerminationReason.MAX_TOKENS: Status.TRUNCATED,
    TerminationReason.TIMEOUT: Status.TRUNCATED,
    TerminationReason.ABORTED: Status.ABORTED,
}
"""Termination reason → sample status (TRUNCATED: a limit ended the episode)."""


class _StepTimeout(Exception):
    """An environment call exceeded `step_timeout_s`."""


@dataclass(frozen=True, slots=True)
class _Turn:
    """One model turn in progress: its index, sampling, token budget, start time, event fields."""

    turn: int
    sampling: Any
    budget: int | None
    """Tokens the whole sample may hold (`max_tokens` or the context; None: unbounded)."""
    started: float
    """`time.perf_counter()` at the turn's start."""
    detail: dict[str, Any]
    """The `TURN_END` event's fields, filled as the turn goes."""


class AgenticGenerate:
    """Runs one `Environment` episode per sample (see the module docstring)."""

    acquires_semaphore: ClassVar[bool] = True
    """`generate_and_rm` leaves the rollout semaphore to this function (taken per request)."""
    max_parked: ClassVar[int] = 4096
    """Aborted episodes whose environment is kept for `on_abort = "resume"` (oldest closed first)."""

    def __init__(
        self,
        config: EnvConfig,
        factory: EnvironmentFactory,
        *,
        semaphore_scope: Literal["request", "episode"] = "request",
    ) -> None:
        self.config = config
        """`[rollout.env]`."""
        self.factory = factory
        """Builds one environment per episode."""
        self.semaphore_scope = semaphore_scope
        """"request" (the default) or "episode" (hold it for the whole episode: the baseline the
        overlap benchmark compares against; never what a run uses)."""
        if semaphore_scope == "episode":
            self.acquires_semaphore = False  # type: ignore[misc]
        self._parked: OrderedDict[str, Environment] = OrderedDict()
        self._episodes: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    # ------------------------------------------------------------------ GenerateFn

    async def __call__(self, inp: GenerateInput) -> Sample:
        limit = self._episode_semaphore()
        async with limit if limit is not None else contextlib.nullcontext():
            return await self._episode(inp)

    async def close(self) -> None:
        """Close parked environments and the factory (if it has a `close`)."""
        parked, self._parked = list(self._parked.values()), OrderedDict()
        for env in parked:
            await env.close()
        close = getattr(self.factory, "close", None)
        if close is not None:
            out = close()
            if asyncio.iscoroutine(out):
                await out

    # ------------------------------------------------------------------ the episode

    def _episode_semaphore(self) -> asyncio.Semaphore | None:
        if self.config.max_episodes_in_flight is None:
            return None
        loop = asyncio.get_running_loop()
        if self._episodes is None or self._episodes[0] is not loop:
            self._episodes = (loop, asyncio.Semaphore(self.config.max_episodes_in_flight))
        return self._episodes[1]

    async def _episode(self, inp: GenerateInput) -> Sample:
        state, sample = inp.state, inp.sample
        emit_on = not inp.evaluation and type(state.context.sink) is not NoopSink

        def emit(kind: EventKind, detail: dict[str, Any]) -> None:
            if emit_on:
                state.context.sink.emit(
                    LifecycleEvent(
                        kind,
                        state.rollout_id,
                        sample.group_index,
                        sample.sample_index,
                        state.weight_version,
                        detail,
                    )
                )

        meta = sample.metadata.get(STATE_KEY)
        if state.aborted.is_set():  # e.g. after waiting for max_episodes_in_flight: start nothing
            sample.status = Status.ABORTED
            return sample
        env = self._parked.pop(meta["episode_id"], None) if meta else None
        # an episode to resume whose environment is not parked here (the process restarted since,
        # or it was evicted from the park) starts over, counted as `resumes_lost`
        lost = env is None and meta is not None and sample.response_length > 0
        if env is None and (sample.response_length or meta):  # not resumable here: start over
            _reset_episode(sample)
        attempt = sample.metadata.get("attempt")
        trace = EpisodeTrace(emit if emit_on else None, attempt=attempt)
        parked = False
        try:
            async with asyncio.timeout(self.config.episode_timeout_s):
                if env is None:
                    env = self._new_env()
                    await self._start(state, sample, env, trace)
                    if lost:
                        sample.metadata["env_metrics"]["resumes_lost"] = 1.0
                reason = await self._turns(inp, env, trace, emit)
        except TimeoutError:
            reason = TerminationReason.TIMEOUT
        except _StepTimeout:
            reason = TerminationReason.TIMEOUT
        except BaseException:
            if env is not None:
                with contextlib.suppress(Exception):
                    await env.close()
            raise
        try:
            if reason is TerminationReason.ABORTED:
                if self.config.on_abort == "resume" and sample.response_length:
                    self._park(sample, env)
                    parked = True
                else:
                    _reset_episode(sample)
        finally:
            if not parked and env is not None:
                await env.close()
        return await _finished(self.config, state, sample, reason)

    async def _start(
        self, state: GenerateState, sample: Sample, env: Environment, trace: EpisodeTrace
    ) -> None:
        obs = as_observation(await self._env_call(env.reset(sample), trace, "env.reset", env))
        if obs is None or obs.is_empty:
            if not sample.tokens:  # (no response either: the prompt ids are all of it)
                from verst.rollout.generate import prompt_token_ids

                sample.tokens = prompt_token_ids(
                    state.tokenizer, sample.prompt, state.config.data.apply_chat_template
                )
            sample.drop_response()  # the prompt's own images stay; earlier observations' go
        else:
            sample.drop_response()
            ids, images = expand_observation(
                state.context.vision, obs, prompt_ids(state.tokenizer, obs), offset=0
            )
            sample.tokens, sample.images = ids, images or None
        sample.metadata[STATE_KEY] = {"episode_id": secrets.token_hex(8), "open_turn": None, "requests": 0}
        sample.metadata["segments"] = []
        sample.metadata["turn_rewards"] = []
        sample.metadata["env_metrics"] = {}
        sample.metadata["env_info"] = {}
        sample.metadata.pop("termination", None)

    async def _turns(
        self, inp: GenerateInput, env: Environment, trace: EpisodeTrace, emit: Any
    ) -> TerminationReason:
        state, sample, params = inp.state, inp.sample, inp.sampling_params
        config, meta = self.config, sample.metadata[STATE_KEY]
        budget = config.max_tokens or state.config.max_context_len
        while True:
            open_turn = meta["open_turn"]  # response offset of a turn cut short by an abort
            turn = _model_turns(sample) - (open_turn is not None)
            if open_turn is None and turn >= config.max_turns:
                return TerminationReason.MAX_TURNS
            so_far = 0 if open_turn is None else sample.response_length - open_turn
            max_new = params.max_new_tokens - so_far
            if budget is not None:
                max_new = min(max_new, budget - len(sample.tokens))
            if max_new <= 0:
                return TerminationReason.MAX_TOKENS
            if state.aborted.is_set():
                return TerminationReason.ABORTED
            trace.turn = turn
            started = time.perf_counter()
            emit(EventKind.TURN_START, {"attempt": trace.attempt, "turn": turn})
            detail: dict[str, Any] = {"attempt": trace.attempt, "turn": turn}
            try:
                sampling = params.replace(max_new_tokens=max_new)
                reason = await self._turn(inp, env, trace, _Turn(turn, sampling, budget, started, detail))
                if reason is not None:
                    return reason
            except BaseException as exc:
                detail.setdefault(
                    "status", "timeout" if isinstance(exc, TimeoutError | _StepTimeout) else "error"
                )
                detail["error"] = type(exc.cause if isinstance(exc, EnvCallError) else exc).__name__
                raise
            finally:
                detail["duration_s"] = time.perf_counter() - started
                if "tokens" in detail:  # the model turn came back: every documented field is set
                    detail.setdefault("env_s", 0.0)  # (0: the environment was not called)
                    detail.setdefault("obs_tokens", 0)  # (0: no observation was appended)
                emit(EventKind.TURN_END, detail)

    async def _turn(
        self, inp: GenerateInput, env: Environment, trace: EpisodeTrace, t: _Turn
    ) -> TerminationReason | None:
        """One model turn and the environment's answer to it; the reason the episode ends, or
        None to go on. `t.detail` gets the turn event's fields (timings, tokens, status)."""
        state, sample, detail = inp.state, inp.sample, t.detail
        out, queue_s = await self._generate(state, sample, t.sampling)
        gen_done = time.perf_counter()
        detail.update(queue_s=queue_s, gen_s=gen_done - t.started - queue_s, tokens=len(out.output_ids))
        if out.finish_reason == "abort" and not out.output_ids:
            detail["status"] = "aborted"
            return TerminationReason.ABORTED
        open_turn, text = self._append_output(state, sample, out, t.turn)
        if out.finish_reason == "abort":
            detail["status"] = "aborted"
            return TerminationReason.ABORTED
        sample.metadata[STATE_KEY]["open_turn"] = None
        if out.finish_reason == "length" and t.budget is not None and len(sample.tokens) >= t.budget:
            detail["status"] = "max_tokens"
            return TerminationReason.MAX_TOKENS
        ids = sample.tokens[len(sample.tokens) - (sample.response_length - open_turn) :]
        resumed = len(ids) != len(out.output_ids)  # the turn spans several requests
        turn_text = state.tokenizer.decode(ids) if resumed and state.tokenizer is not None else text
        model_turn = ModelTurn(t.turn, tuple(ids), turn_text, out.finish_reason)
        try:
            result = await self._env_call(env.step(model_turn), trace, "env.step", env)
        finally:
            detail["env_s"] = time.perf_counter() - gen_done
        reason = self._record(sample, result)
        if reason is not None:
            detail["status"] = reason.value
            return reason
        return self._observe(state, sample, result, t)

    def _append_output(
        self, state: GenerateState, sample: Sample, out: GenerateOutput, turn: int
    ) -> tuple[int, str]:
        """Append the engine's output as (part of) model turn `turn`; returns the turn's response
        offset (it may have started in an earlier, aborted request) and the output's text."""
        meta = sample.metadata[STATE_KEY]
        text = out.text or (
            state.tokenizer.decode(out.output_ids) if state.tokenizer and out.output_ids else ""
        )
        if meta["open_turn"] is None:
            meta["open_turn"] = sample.response_length
        append_turn(
            sample,
            out.output_ids,
            out.output_logprobs if len(out.output_logprobs) == len(out.output_ids) else None,
            True,
            out.weight_version,
            text=text,
            turn=turn,
            routed_experts=out.routed_experts,
            routed_start=sample.routed_experts.tokens if sample.routed_experts is not None else 0,
        )
        if state.config.mask_offpolicy_in_partial_rollout:
            mask_turns_before(sample, out.weight_version)
        return meta["open_turn"], text

    def _observe(
        self, state: GenerateState, sample: Sample, result: StepResult, t: _Turn
    ) -> TerminationReason | None:
        """Append the environment's observation (loss mask 0); MAX_TOKENS when it does not fit."""
        obs = as_observation(result.observation)
        obs_ids = observation_ids(state.tokenizer, obs) if obs is not None and not obs.is_empty else []
        obs_ids, obs_images = expand_observation(
            state.context.vision, obs, obs_ids, offset=len(sample.tokens)
        )
        if t.budget is not None and len(sample.tokens) + len(obs_ids) > t.budget:
            t.detail["status"] = "max_tokens"
            return TerminationReason.MAX_TOKENS
        if obs_ids:
            text = obs.text if obs is not None and obs.token_ids is None and not obs.messages else None
            if text is None and state.tokenizer is not None:
                text = state.tokenizer.decode(obs_ids)
            append_turn(sample, obs_ids, None, False, text=text, turn=t.turn)
            if obs_images:
                sample.images = [*(sample.images or []), *obs_images]
        t.detail["obs_tokens"] = len(obs_ids)
        t.detail["status"] = "continue"
        return None

    async def _generate(
        self, state: GenerateState, sample: Sample, sampling: Any
    ) -> tuple[GenerateOutput, float]:
        meta = sample.metadata[STATE_KEY]
        k = meta["requests"]
        meta["requests"] = k + 1
        from verst.rollout.generate import request_images

        request = GenerateRequest(
            input_ids=list(sample.tokens),
            sampling=sampling,
            rid=f"{_request_prefix(state)}-{sample.sample_index}-{sample.metadata.get('attempt', 0)}-{k}",
            return_routed_experts=state.config.return_routed_experts,
            # only the positions this call adds (the earlier ones are recorded already)
            routed_experts_start_len=sample.routed_experts.tokens if sample.routed_experts is not None else 0,
            images=request_images(sample),
        )
        waited = time.perf_counter()
        if self.semaphore_scope == "episode":
            return await state.engine.generate(request), 0.0
        async with state.semaphore:
            queue_s = time.perf_counter() - waited
            if state.aborted.is_set():
                return GenerateOutput([], [], "abort", state.weight_version), queue_s
            return await state.engine.generate(request), queue_s

    def _new_env(self) -> Environment:
        try:
            return self.factory()
        except Exception as exc:
            raise EnvCallError("env factory", f"rollout.env.type={self.config.type!r}", exc) from exc

    async def _env_call(self, call: Awaitable[T], trace: EpisodeTrace, what: str, env: Environment) -> T:
        """Await one environment call within `step_timeout_s`; what it raises is an `EnvCallError`
        naming the call (`what`) and the environment class."""
        with episode_trace(trace):
            try:
                return await asyncio.wait_for(call, self.config.step_timeout_s)
            except TimeoutError:
                raise _StepTimeout() from None
            except Exception as exc:
                raise EnvCallError(what, type(env).__name__, exc) from exc

    def _record(self, sample: Sample, result: StepResult) -> TerminationReason | None:
        """Keep the step's reward, metrics and info; the termination reason if it ended."""
        if not isinstance(result, StepResult):
            raise TypeError(f"Environment.step returned {type(result).__name__}; return a StepResult")
        sample.metadata["turn_rewards"].append(result.reward)
        totals = sample.metadata["env_metrics"]
        for name, value in result.metrics.items():
            totals[name] = totals.get(name, 0.0) + float(value)
        sample.metadata["env_info"].update(result.info)
        if not result.done:
            return None
        return TerminationReason(result.termination or TerminationReason.ENV_DONE)

    def _park(self, sample: Sample, env: Environment) -> None:
        self._parked[sample.metadata[STATE_KEY]["episode_id"]] = env
        while len(self._parked) > self.max_parked:
            _, oldest = self._parked.popitem(last=False)
            task = asyncio.ensure_future(oldest.close())
            task.add_done_callback(lambda t: t.exception())


def episode_generate_fn(context: RolloutContext) -> AgenticGenerate:
    """The episode loop for `context.config.env` (raises `ConfigError` on a bad `[rollout.env]`)."""
    from verst.rollout.agentic.loading import build_env_factory

    env_config = context.config.env
    if env_config is None:
        raise ValueError("rollout.env is not set")
    factory = build_env_factory(env_config, EnvSetup(tokenizer=context.tokenizer, seed=context.config.seed))
    return AgenticGenerate(env_config, factory)


# --------------------------------------------------------------------------- helpers


def _request_prefix(state: GenerateState) -> str:
    from verst.rollout.generate import request_prefix

    return request_prefix(state)


def _model_turns(sample: Sample) -> int:
    turns = {seg["turn"] for seg in segments_of(sample) if seg["source"] == "model"}
    return len(turns)


def _reset_episode(sample: Sample) -> None:
    """Back to the prompt: no turns, no episode state."""
    sample.drop_response()
    for key in METADATA_KEYS:
        sample.metadata.pop(key, None)


async def _finished(
    config: EnvConfig, state: GenerateState, sample: Sample, reason: TerminationReason
) -> Sample:
    """`_finish`, then (`per_turn_reward_fn`) `rollout.reward` scores each turn of the episode."""
    _finish(config, state, sample, reason)
    if config.reward == "per_turn_reward_fn" and reason is not TerminationReason.ABORTED:
        from verst.rollout.agentic.turn_rewards import score_turns

        await score_turns(sample, state.context.reward_fn, state.tokenizer, state.config.reward.key)
    return sample


def _finish(config: EnvConfig, state: GenerateState, sample: Sample, reason: TerminationReason) -> Sample:
    sample.status = STATUS_BY_TERMINATION[reason]
    sample.metadata["termination"] = reason.value
    if reason is TerminationReason.ABORTED:
        if sample.response_length:
            sample.metadata.setdefault("start_rollout_id", state.rollout_id)
        return sample
    if config.reward not in ("reward_fn", "per_turn_reward_fn"):
        rewards = [r for r in sample.metadata.get("turn_rewards", []) if r is not None]
        if rewards:
            sample.reward = float(rewards[-1] if config.reward == "final" else sum(rewards))
    if config.reward == "per_turn":
        from verst.rollout.agentic.turn_rewards import POSITIONS_KEY, turn_reward_positions

        sample.metadata[POSITIONS_KEY] = turn_reward_positions(sample)
    return sample
