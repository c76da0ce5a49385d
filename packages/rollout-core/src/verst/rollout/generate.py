"""Generating one sample (`generate_and_rm`) or one group (`generate_and_rm_group`).

`SingleTurnGenerate` is the default `GenerateFn`: prompt → one engine request → response.
It resumes aborted samples that hold partial tokens (partial rollout) and, with
`mask_offpolicy_in_partial_rollout`, loss-masks every token generated under weights older than
the newest (by `Sample.token_versions`, not by rollout id: under fully-async a request aborted
by a weight update is resumed within the same rollout).

`generate_and_rm` wraps any generate function with what every attempt needs: the semaphore,
the abort flag, the per-sample generate override, the reward, and the lifecycle events
`attempt_start` (before the semaphore wait) → `gen_start` → `gen_end` → `attempt_end` (in a
`finally`: exactly once on success, abort, exception and cancellation). Eval emits nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from typing import Any

from verst.rollout.engine import GenerateOutput, GenerateRequest, SamplingParams
from verst.rollout.lifecycle import EventKind, LifecycleEvent, NoopSink
from verst.rollout.logging_utils import sample_text_preview
from verst.rollout.protocols import GenerateFn, GenerateInput, GenerateState
from verst.rollout.sample import EPISODE_METADATA_KEYS, Sample, Status
from verst.rollout.sampling import derive_sample_seed

STATUS_BY_FINISH_REASON: dict[str, Status] = {
    "stop": Status.COMPLETED,
    "length": Status.TRUNCATED,
    "abort": Status.ABORTED,
}
"""Engine finish reason → sample status."""

_RUN_METADATA_KEYS = ("attempt", "error", "start_rollout_id", "reward_outcome", *EPISODE_METADATA_KEYS)
"""Per-run metadata removed when a sample is reset to a fresh prompt."""


class GenerateContractError(TypeError):
    """A generate function returned something the rollout cannot train on (never retried)."""


class GroupGenerationError(RuntimeError):
    """One sample of a group raised; its siblings were cancelled. Carries the group and the cause."""

    def __init__(self, group: list[Sample], cause: BaseException) -> None:
        self.group = group
        """The group's samples (as far as they got)."""
        self.cause = cause
        """The first exception raised by a sample."""
        where = next((s.sample_index for s in group if s.metadata.get("error")), None)
        super().__init__(
            f"generation of group {group[0].group_index if group else None} failed"
            f"{f' at sample {where}' if where is not None else ''}: {type(cause).__name__}: "
            f"{sample_text_preview(str(cause), 300)}"
        )


# --------------------------------------------------------------------------- pure helpers


def resumed_loss_mask(
    previous_mask: list[int] | None, previous_len: int, new_len: int, *, mask_offpolicy: bool
) -> list[int] | None:
    """The loss mask after appending `new_len` freshly generated tokens to a partial response.

    `previous_mask` covers the `previous_len` tokens generated earlier (None = all ones). With
    `mask_offpolicy` those earlier tokens (generated under older weights) get 0; the new ones
    always get 1. Returns None when the result is all ones (the `Sample` convention).
    """
    if previous_mask is not None and len(previous_mask) != previous_len:
        raise ValueError(f"previous loss mask has {len(previous_mask)} entries for {previous_len} tokens")
    if mask_offpolicy:
        head = [0] * previous_len
    elif previous_mask is None:
        return None
    else:
        head = list(previous_mask)
    mask = head + [1] * new_len
    return None if all(mask) else mask


def offpolicy_loss_mask(loss_mask: list[int] | None, token_versions: list[int]) -> list[int] | None:
    """`loss_mask` with every token older than the newest version in `token_versions` set to 0.

    `token_versions` has one weight version per response token (`Sample.token_versions`); the
    newest one is the policy being trained, so only tokens generated under it keep their mask.
    Returns None when the result is all ones (the `Sample` convention).
    """
    if loss_mask is not None and len(loss_mask) != len(token_versions):
        raise ValueError(f"loss mask has {len(loss_mask)} entries for {len(token_versions)} token versions")
    if not token_versions:
        return loss_mask
    newest = max(token_versions)
    mask = loss_mask if loss_mask is not None else [1] * len(token_versions)
    out = [m if v >= newest else 0 for m, v in zip(mask, token_versions, strict=True)]
    return None if all(out) else out


def previous_token_versions(sample: Sample, previous_len: int) -> list[int]:
    """The versions of a sample's first `previous_len` response tokens: `token_versions` when
    it covers them, else (an older checkpoint, a custom generate function) the oldest version
    the sample recorded for all of them — masking too much rather than too little."""
    versions = sample.token_versions
    if versions is not None and len(versions) == previous_len:
        return list(versions)
    return [min(sample.weight_versions, default=-1)] * previous_len


def reset_sample(sample: Sample, *, keep_attempt: bool = False) -> Sample:
    """Turn a sample back into a fresh PENDING prompt sample (keeps the cached prompt ids).

    `keep_attempt` keeps the attempt counter, so a resubmitted sample gets a new request id.
    """
    sample.drop_response()
    sample.reward = None
    sample.routed_experts = None
    sample.status = Status.PENDING
    for key in _RUN_METADATA_KEYS:
        if not (keep_attempt and key == "attempt"):
            sample.metadata.pop(key, None)
    return sample


def request_prefix(state: GenerateState) -> str:
    """The request-id prefix of the rollout `state` belongs to."""
    return state.request_prefix or f"r{state.rollout_id}"


def sample_adapter(sample: Sample, key: str) -> str | None:
    """The LoRA adapter a sample names in `metadata[key]` (multi-LoRA), or None (the default)."""
    name = sample.metadata.get(key)
    return None if name is None or name == "" else str(name)


def request_images(sample: Sample) -> tuple[Any, ...]:
    """The sample's images as the engine takes them (`PromptImage` recipes; empty for text)."""
    if not sample.images:
        return ()
    from verst.rollout.multimodal.processor import PromptImage

    return tuple(PromptImage.from_dict(d) for d in sample.images)


def prompt_token_ids(tokenizer: Any, prompt: Any, apply_chat_template: bool) -> list[int]:
    """Token ids of a prompt: text, or chat messages rendered with the chat template."""
    if tokenizer is None:
        raise ValueError(
            "the sample has no prompt token ids and the rollout context has no tokenizer; "
            "pass a tokenizer in RolloutContext or pre-tokenize prompts into sample.tokens"
        )
    if isinstance(prompt, list) or apply_chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    return list(tokenizer.encode(text, add_special_tokens=False))


# --------------------------------------------------------------------------- default generate fn


class SingleTurnGenerate:
    """The default `GenerateFn`: one engine request per sample, resuming partial samples."""

    prompt_cache_size: int = 4096
    """Text prompts whose token ids are remembered (a group's samples share one prompt)."""

    def _token_ids(self, tokenizer: Any, prompt: Any, apply_chat_template: bool) -> list[int]:
        """`prompt_token_ids`, memoised for text prompts (per tokenizer object, LRU)."""
        if not isinstance(prompt, str) or tokenizer is None:
            return prompt_token_ids(tokenizer, prompt, apply_chat_template)
        cache: OrderedDict[tuple[str, bool], list[int]] | None = self.__dict__.get("_prompt_ids")
        if cache is None or self.__dict__.get("_prompt_tokenizer") is not tokenizer:
            cache = self._prompt_ids = OrderedDict()  # subclasses need not call an __init__
            self._prompt_tokenizer = tokenizer
        key = (prompt, apply_chat_template)
        ids = cache.get(key)
        if ids is None:
            ids = cache[key] = prompt_token_ids(tokenizer, prompt, apply_chat_template)
            if len(cache) > self.prompt_cache_size:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        return list(ids)

    async def __call__(self, inp: GenerateInput) -> Sample:
        state, sample, params = inp.state, inp.sample, inp.sampling_params
        config = state.config
        if not sample.tokens:
            sample.tokens = self._token_ids(state.tokenizer, sample.prompt, config.data.apply_chat_template)
            sample.response_length = 0
        previous_len = sample.response_length
        max_new = params.max_new_tokens - previous_len
        if config.max_context_len is not None:
            max_new = min(max_new, config.max_context_len - len(sample.tokens))
        if max_new <= 0:
            sample.status = Status.TRUNCATED
            return sample
        if state.aborted.is_set():
            return _mark_aborted(sample, state)
        attempt = sample.metadata.get("attempt", 0)
        request = GenerateRequest(
            input_ids=sample.tokens,
            sampling=params if max_new == params.max_new_tokens else params.replace(max_new_tokens=max_new),
            rid=f"{request_prefix(state)}-{sample.sample_index}-{attempt}",
            lora_path=sample_adapter(sample, config.lora_key),
            return_routed_experts=config.return_routed_experts,
            images=request_images(sample),
        )
        output = await state.engine.generate(request)
        return self.apply_output(state, sample, output, previous_len)

    def apply_output(
        self, state: GenerateState, sample: Sample, out: GenerateOutput, previous_len: int
    ) -> Sample:
        """Append an engine output to the sample (tokens, log-probs, mask, status, version)."""
        config = state.config
        new_ids = out.output_ids
        n_new = len(new_ids)
        fresh = out.output_token_versions
        if fresh is None or len(fresh) != n_new:  # one version for the whole answer
            fresh = [out.weight_version] * n_new
        if previous_len == 0:  # the common case: one segment, every token trained on
            sample.loss_mask = None
            if config.mask_offpolicy_in_partial_rollout and len(set(fresh)) > 1:  # refit mid-request
                sample.loss_mask = offpolicy_loss_mask(None, fresh)
            sample.token_versions = list(fresh)
        else:
            versions = previous_token_versions(sample, previous_len) + list(fresh)
            sample.loss_mask = resumed_loss_mask(sample.loss_mask, previous_len, n_new, mask_offpolicy=False)
            if config.mask_offpolicy_in_partial_rollout:
                sample.loss_mask = offpolicy_loss_mask(sample.loss_mask, versions)
            sample.token_versions = versions
        if previous_len == 0:
            sample.rollout_logprobs = list(out.output_logprobs) if len(out.output_logprobs) == n_new else None
        elif sample.rollout_logprobs is not None and len(out.output_logprobs) == n_new:
            sample.rollout_logprobs = sample.rollout_logprobs + list(out.output_logprobs)
        else:
            sample.rollout_logprobs = None
        sample.tokens = sample.tokens + list(new_ids)
        sample.response_length = previous_len + n_new
        routed = out.routed_experts  # the whole sequence's (start 0): replaces a partial's
        sample.routed_experts = (
            routed if routed is not None and routed.tokens == len(sample.tokens) - 1 else None
        )
        text = out.text
        if not text and n_new and state.tokenizer is not None:
            text = state.tokenizer.decode(new_ids)
        sample.response = sample.response + text if previous_len else text
        sample.weight_versions = [*sample.weight_versions, out.weight_version]
        status = STATUS_BY_FINISH_REASON.get(out.finish_reason)
        if status is None:
            raise ValueError(f"engine returned unknown finish reason {out.finish_reason!r}")
        sample.status = status
        if status is Status.ABORTED:
            sample.metadata.setdefault("start_rollout_id", state.rollout_id)
        return sample


def _mark_aborted(sample: Sample, state: GenerateState) -> Sample:
    sample.status = Status.ABORTED
    if sample.response_length:
        sample.metadata.setdefault("start_rollout_id", state.rollout_id)
    return sample


# --------------------------------------------------------------------------- generate_and_rm


def _emit(state: GenerateState, kind: EventKind, sample: Sample, detail: dict[str, Any]) -> None:
    state.context.sink.emit(
        LifecycleEvent(
            kind, state.rollout_id, sample.group_index, sample.sample_index, state.weight_version, detail
        )
    )


def generate_fn_for(state: GenerateState, sample: Sample) -> GenerateFn:
    """The sample's own generate function (loaded once per path) or the strategy's."""
    path = sample.generate_function_path
    if path:
        fn = state.generate_fn_cache.get(path)
        if fn is None:
            from verst.rollout.loading import load_generate_function

            fn = load_generate_function(path, state.config, v1_args=state.context.v1_args)
            state.generate_fn_cache[path] = fn
        return fn
    if state.generate_fn is None:
        state.generate_fn = SingleTurnGenerate()
    return state.generate_fn


async def _score(state: GenerateState, sample: Sample) -> None:
    """Compute the sample's reward; a raising reward fn marks it FAILED with the error."""
    reward_fn = state.context.reward_fn
    if reward_fn is None or sample.reward is not None:
        return
    try:
        sample.reward = await reward_fn(sample)
    except Exception as exc:
        sample.status = Status.FAILED
        sample.metadata["error"] = f"reward: {type(exc).__name__}: {sample_text_preview(str(exc), 300)}"


async def generate_and_rm(
    state: GenerateState, sample: Sample, sampling_params: SamplingParams, evaluation: bool = False
) -> Sample | list[Sample]:
    """Generate one sample and score it (see the module docstring for the lifecycle contract)."""
    if sample.status.is_finished:
        return sample
    emit = not evaluation and type(state.context.sink) is not NoopSink
    attempt = sample.metadata.get("attempt", -1) + 1
    sample.metadata["attempt"] = attempt
    if emit:
        _emit(state, EventKind.ATTEMPT_START, sample, {"attempt": attempt})
    end_detail: dict[str, Any] = {"attempt": attempt}
    result: Sample | list[Sample] = sample
    try:
        if state.aborted.is_set():
            return _mark_aborted(sample, state)
        fn = generate_fn_for(state, sample)
        # an agentic episode takes the semaphore per engine request itself (not per episode)
        async with contextlib.nullcontext() if getattr(fn, "acquires_semaphore", False) else state.semaphore:
            if state.aborted.is_set():
                return _mark_aborted(sample, state)
            # SamplingParams is frozen, so sharing it is as safe as a copy; a seed makes a new one.
            params = sampling_params
            if params.sampling_seed is not None:
                seed = derive_sample_seed(
                    params.sampling_seed, state.rollout_id, sample.sample_index, attempt
                )
                params = params.replace(sampling_seed=seed)
            if emit:
                _emit(state, EventKind.GEN_START, sample, {"attempt": attempt})
            result = await fn(GenerateInput(state, sample, params, evaluation))
            if emit:
                _emit(state, EventKind.GEN_END, sample, _gen_detail(result))
        if not state.config.reward.group:
            for s in result if isinstance(result, list) else (result,):
                if s.status.is_finished:
                    await _score(state, s)
        return result
    except BaseException as exc:
        end_detail["error"] = type(exc).__name__
        if not isinstance(exc, asyncio.CancelledError):
            end_detail["message"] = sample_text_preview(str(exc), 200)
            sample.metadata["error"] = f"generate: {type(exc).__name__}: {end_detail['message']}"
        raise
    finally:
        if emit:
            end_detail["status"] = (
                "cancelled" if end_detail.get("error") == "CancelledError" else _status_of(result)
            )
            _emit(state, EventKind.ATTEMPT_END, sample, end_detail)


def _status_of(result: Sample | list[Sample]) -> str:
    if isinstance(result, list):
        return result[-1].status.value if result else "empty"
    return result.status.value


def _gen_detail(result: Sample | list[Sample]) -> dict[str, Any]:
    samples = result if isinstance(result, list) else (result,)
    return {"status": _status_of(result), "response_tokens": sum(s.response_length for s in samples)}


# --------------------------------------------------------------------------- groups


async def _score_group(state: GenerateState, samples: list[Sample]) -> None:
    group_fn = state.context.group_reward_fn
    if group_fn is None or not all(s.status.is_finished for s in samples):
        return
    try:
        rewards = await group_fn(samples)
        if len(rewards) != len(samples):
            raise ValueError(f"group reward fn returned {len(rewards)} rewards for {len(samples)} samples")
    except Exception as exc:
        error = f"reward: {type(exc).__name__}: {sample_text_preview(str(exc), 300)}"
        for s in samples:
            s.status = Status.FAILED
            s.metadata["error"] = error
        return
    for s, r in zip(samples, rewards, strict=True):
        s.reward = r


async def generate_and_rm_group(
    state: GenerateState, group: list[Sample], sampling_params: SamplingParams, evaluation: bool = False
) -> list[Sample]:
    """Generate a group concurrently; if one sample raises, cancel the rest and raise
    `GroupGenerationError`. Applies the group reward when `config.reward.group` is on."""
    try:
        if len(group) == 1:
            results: list[Any] = [await generate_and_rm(state, group[0], sampling_params, evaluation)]
        else:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(generate_and_rm(state, s, sampling_params, evaluation)) for s in group
                ]
            results = [t.result() for t in tasks]
    except asyncio.CancelledError:
        raise
    except ExceptionGroup as eg:  # a KeyboardInterrupt/SystemExit group propagates
        cause = _first_leaf(eg)
        raise GroupGenerationError(group, cause) from cause
    except Exception as exc:
        raise GroupGenerationError(group, exc) from exc
    samples = [_one_sample(r, s) for r, s in zip(results, group, strict=True)]
    if state.config.reward.group:
        await _score_group(state, samples)
    return samples


def _one_sample(result: Sample | list[Sample], submitted: Sample) -> Sample:
    """The one sample a generate call must produce (a multi-turn episode is ONE sample)."""
    if isinstance(result, Sample):
        return result
    if isinstance(result, list) and len(result) == 1 and isinstance(result[0], Sample):
        return result[0]
    got = f"a list of {len(result)} samples" if isinstance(result, list) else type(result).__name__
    raise GenerateContractError(
        f"the generate function returned {got} for sample {submitted.sample_index}; a generate "
        "function must return exactly one Sample per input sample (groups of unequal size cannot "
        "be trained on, and regrouping turns as samples would bias GRPO advantages). For a "
        "multi-turn episode, build ONE sample with verst.rollout.agentic.append_turn (one call "
        "per turn; loss mask 0 on injected tokens), or configure [rollout.env] and let the "
        "built-in episode loop do it; see docs/agentic.md"
    )


def _first_leaf(eg: BaseException) -> BaseException:
    while isinstance(eg, BaseExceptionGroup):
        eg = eg.exceptions[0]
    return eg
