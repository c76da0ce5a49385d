"""Observations → token ids, each tokenized exactly once, when it arrives.

Text is encoded without special tokens. Chat messages are rendered as the *continuation* of a
conversation: the chat template is applied to a fixed stand-in conversation with and without
the new messages (plus the generation prompt), and the added suffix is encoded. The model's own
turns are never rendered or re-tokenised; they stay the exact ids the engine generated.
"""

from __future__ import annotations

from typing import Any

from verst.rollout.agentic.environment import Observation, ObservationLike

_STAND_IN = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
"""The conversation the delta of new messages is taken against."""


def as_observation(obs: ObservationLike) -> Observation | None:
    """Normalise what an environment returned (plain text → `Observation(text=...)`)."""
    if obs is None or isinstance(obs, Observation):
        return obs
    if isinstance(obs, str):
        return Observation(text=obs)
    raise TypeError(
        f"an environment returned an observation of type {type(obs).__name__}; "
        "return an Observation, a str, or None"
    )


def _need_tokenizer(tokenizer: Any) -> Any:
    if tokenizer is None:
        raise ValueError(
            "an environment observation must be tokenized but the rollout has no tokenizer; "
            "pass one in RolloutContext or return Observation(token_ids=...)"
        )
    return tokenizer


def _template(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool, tools: Any) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "the environment returned chat messages but the tokenizer has no chat template; "
            "return Observation(text=...) instead, or use a tokenizer with a chat template"
        )
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
    if tools:
        kwargs["tools"] = list(tools)
    return tokenizer.apply_chat_template(messages, **kwargs)


def prompt_ids(tokenizer: Any, obs: Observation) -> list[int]:
    """Token ids of a first observation (the episode's prompt)."""
    if obs.token_ids is not None:
        return list(obs.token_ids)
    tokenizer = _need_tokenizer(tokenizer)
    if obs.messages:
        text = _template(tokenizer, list(obs.messages), generation_prompt=True, tools=obs.tools)
    else:
        text = obs.text
    return list(tokenizer.encode(text, add_special_tokens=False))


def observation_ids(tokenizer: Any, obs: Observation) -> list[int]:
    """Token ids of an observation appended after a model turn."""
    if obs.token_ids is not None:
        return list(obs.token_ids)
    tokenizer = _need_tokenizer(tokenizer)
    if obs.messages:
        base = _template(tokenizer, _STAND_IN, generation_prompt=False, tools=None)
        full = _template(tokenizer, [*_STAND_IN, *obs.messages], generation_prompt=True, tools=None)
        if not full.startswith(base):
            raise ValueError(
                "the chat template does not render new messages as a suffix of the conversation; "
                "return Observation(text=...) with the exact text to append instead"
            )
        text = full[len(base) :]
    else:
        text = obs.text
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []
