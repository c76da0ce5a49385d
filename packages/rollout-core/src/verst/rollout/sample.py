"""`Sample`: one trajectory (prompt + response) as it moves through rollout and training.

A sample is created by the data source (PENDING, prompt only), filled in by a generate
function (tokens, response, log-probs, status), scored by a reward function, and consumed by
the trainer. Its length invariants are checked in exactly one place, `Sample.validate`; a
multi-turn sample's segments (built by `verst.rollout.agentic.trajectory.append_turn`) are
checked there too, by `trajectory_problems`.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from verst.rollout.moe import RoutedExperts


class Status(enum.StrEnum):
    """Where a sample is in its life."""

    PENDING = "pending"
    """Not generated yet (or handed back to the data source to be generated again)."""
    COMPLETED = "completed"
    """Generation stopped on a stop token / stop string."""
    TRUNCATED = "truncated"
    """Generation hit `max_new_tokens` or the context limit."""
    ABORTED = "aborted"
    """Generation was aborted (target reached, weight update, shutdown); may hold partial tokens."""
    FAILED = "failed"
    """Generation or reward failed after its retries; the error is in `metadata["error"]`."""

    @property
    def is_finished(self) -> bool:
        """True for COMPLETED and TRUNCATED: the sample needs no more generation."""
        return self in (Status.COMPLETED, Status.TRUNCATED)


class SampleInvariantError(ValueError):
    """A sample's fields disagree with each other (e.g. a loss mask of the wrong length)."""


@dataclass
class Sample:
    """One prompt and (after generation) one response, with everything training needs."""

    prompt: str | list[dict[str, Any]] = ""
    """The prompt: plain text, or chat messages (`[{"role": ..., "content": ...}]`)."""
    label: Any = None
    """The reference answer the reward function compares against."""
    tokens: list[int] = field(default_factory=list)
    """Prompt token ids followed by response token ids."""
    response_length: int = 0
    """Number of response tokens at the end of `tokens`."""
    response: str = ""
    """Decoded response text."""
    reward: float | dict[str, float] | None = None
    """Scalar reward, or a dict of named rewards (the trainer reads `reward_key` from it)."""
    loss_mask: list[int] | None = None
    """Per response token, 1 = trained on, 0 = ignored. None means all ones."""
    rollout_logprobs: list[float] | None = None
    """Per response token, the engine's log-prob of the sampled token."""
    status: Status = Status.PENDING
    """Lifecycle status; see `Status`."""
    weight_versions: list[int] = field(default_factory=list)
    """Engine weight versions this sample was generated with, one per engine call (several for
    resumed partial samples and multi-turn trajectories)."""
    token_versions: list[int] | None = None
    """Per response token, the weight version of the engine call that produced it (None = not
    tracked). Tokens an engine call did not produce (tool/environment output in a multi-turn
    trajectory) carry the version of the call before them. With
    `mask_offpolicy_in_partial_rollout` every response token whose version is older than the
    newest is loss-masked (`offpolicy_loss_mask`), whatever the rollout id; a generate function
    that appends a segment extends it with `[version] * len(segment)`."""
    routed_experts: RoutedExperts | None = None
    """MoE models: the experts the engine chose at every position fed as input (`len(tokens) - 1`
    rows of layers × k ids, uint8/int16; -1 = not recorded, e.g. observation tokens of an agentic
    trajectory), for `train.moe.routing_replay = 'rollout'` (`verst.rollout.moe`)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form per-sample data (dataset fields, `start_rollout_id`, errors, teacher ids...)."""
    generate_function_path: str | None = None
    """Import path of a generate function that overrides the strategy's for this sample."""
    group_index: int | None = None
    """Index of this sample's group (prompt) within its rollout."""
    sample_index: int | None = None
    """Index of this sample within all samples of its rollout (unique, stable)."""
    images: list[dict[str, Any]] | None = None
    """Images in `tokens` (vision-language models): per image its file `path`, `sha256`, token
    `offset` and `length`, and the processor's output `shapes` — the recipe the engine and the
    trainer rebuild the pixels from (`verst.rollout.multimodal.PromptImage`), never the pixels."""

    # ---- slime / miles names (the v1 ABI): the same data under the names their functions use
    Status: ClassVar[type[Status]] = Status
    """`Sample.Status.COMPLETED` works as in slime (the same enum as `verst.rollout.sample.Status`)."""

    @property
    def rollout_log_probs(self) -> list[float] | None:
        """slime's name of `rollout_logprobs` (read and write)."""
        return self.rollout_logprobs

    @rollout_log_probs.setter
    def rollout_log_probs(self, value: list[float] | None) -> None:
        self.rollout_logprobs = None if value is None else [float(v) for v in value]

    @property
    def index(self) -> int | None:
        """slime's name of `sample_index` (read and write)."""
        return self.sample_index

    @index.setter
    def index(self, value: int | None) -> None:
        self.sample_index = value

    @property
    def effective_response_length(self) -> int:
        """Response tokens that are trained on (slime's `effective_response_length`)."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def get_reward_value(self, args: Any) -> float:
        """slime's `get_reward_value(args)`: the reward, or `reward[args.reward_key]`."""
        return self.scalar_reward(getattr(args, "reward_key", None))

    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens at the start of `tokens`."""
        return len(self.tokens) - self.response_length

    def drop_response(self) -> None:
        """Back to the prompt: `tokens` cut to it (and `images` to the prompt's own), no response
        text, loss mask, rollout log-probs or weight versions. Reward, status, routing and
        metadata are the caller's to reset."""
        self.tokens = self.tokens[: self.prompt_length]
        if self.images:  # an image a multi-turn episode appended after the prompt goes with it
            self.images = [im for im in self.images if int(im["offset"]) < len(self.tokens)] or None
        self.response_length = 0
        self.response = ""
        self.loss_mask = None
        self.rollout_logprobs = None
        self.weight_versions = []
        self.token_versions = None

    @property
    def response_tokens(self) -> list[int]:
        """The response part of `tokens`."""
        return self.tokens[len(self.tokens) - self.response_length :] if self.response_length else []

    def effective_loss_mask(self) -> list[int]:
        """The loss mask with None expanded to all ones."""
        return list(self.loss_mask) if self.loss_mask is not None else [1] * self.response_length

    def scalar_reward(self, reward_key: str | None = None) -> float:
        """The reward as a float: `reward` itself, or `reward[reward_key]` for dict rewards."""
        if self.reward is None:
            raise SampleInvariantError(f"sample {self.sample_index} has no reward yet")
        if isinstance(self.reward, dict):
            if reward_key is None or reward_key not in self.reward:
                raise SampleInvariantError(
                    f"sample {self.sample_index} has a dict reward with keys {sorted(self.reward)}; "
                    f"set rollout.reward_key to one of them (got {reward_key!r})"
                )
            return float(self.reward[reward_key])
        return float(self.reward)

    def validate(self) -> None:
        """Check the length invariants (and, for a multi-turn trajectory, its segments: contiguous,
        covering the response, loss mask 0 on injected tokens; see `verst.rollout.agentic`);
        raise `SampleInvariantError` naming every broken one."""
        problems = []
        if not 0 <= self.response_length <= len(self.tokens):
            problems.append(
                f"response_length={self.response_length} outside [0, len(tokens)={len(self.tokens)}]"
            )
        if self.loss_mask is not None:
            if len(self.loss_mask) != self.response_length:
                problems.append(
                    f"len(loss_mask)={len(self.loss_mask)} != response_length={self.response_length}"
                )
            if any(m not in (0, 1) for m in self.loss_mask):
                problems.append("loss_mask holds values other than 0 and 1")
        if self.rollout_logprobs is not None and len(self.rollout_logprobs) != self.response_length:
            problems.append(
                f"len(rollout_logprobs)={len(self.rollout_logprobs)} != response_length={self.response_length}"
            )
        if self.token_versions is not None and len(self.token_versions) != self.response_length:
            problems.append(
                f"len(token_versions)={len(self.token_versions)} != response_length={self.response_length}"
            )
        if self.routed_experts is not None and self.routed_experts.tokens != max(len(self.tokens) - 1, 0):
            problems.append(
                f"routed_experts covers {self.routed_experts.tokens} positions, expected len(tokens) - 1 = "
                f"{max(len(self.tokens) - 1, 0)}"
            )
        if "segments" in self.metadata:  # a multi-turn trajectory built with append_turn
            problems += trajectory_problems(self)
        if problems:
            raise SampleInvariantError(f"sample {self.sample_index}: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict; `Sample.from_dict(s.to_dict()) == s`."""
        out = asdict(self)
        out["status"] = self.status.value
        if self.routed_experts is not None:
            out["routed_experts"] = self.routed_experts.to_json()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of `to_dict`; unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown Sample fields {sorted(unknown)}; valid fields: {sorted(known)}")
        data = copy.deepcopy(dict(data))
        if "status" in data:
            data["status"] = Status(data["status"])
        if isinstance(data.get("routed_experts"), dict):
            data["routed_experts"] = RoutedExperts.from_json(data["routed_experts"])
        return cls(**data)

    def clone(self) -> Sample:
        """A deep copy (groups are built by cloning the data source's prompt sample).

        The same result as `copy.deepcopy(self)`, built faster (it runs once per sample of every
        rollout): immutable field values are kept as they are, flat lists and dicts of immutable
        values are copied in one step, anything else goes through `copy.deepcopy` with one memo
        shared by all fields, so objects shared between fields stay shared in the copy."""
        if type(self) is not Sample:  # a subclass may copy itself its own way
            return copy.deepcopy(self)
        new = object.__new__(Sample)
        memo: dict[int, Any] = {id(self): new}
        new.__dict__.update({k: _deep_copy(v, memo) for k, v in self.__dict__.items()})
        return new


_IMMUTABLE: frozenset[type] = frozenset({type(None), bool, int, float, complex, str, bytes, Status})
"""Types whose values `copy.deepcopy` returns as they are (exact types, not subclasses)."""


def _deep_copy(value: Any, memo: dict[int, Any]) -> Any:
    """`copy.deepcopy(value, memo)`, with a fast path for immutable values and for flat lists and
    dicts of them (a shallow copy of those is a deep one)."""
    kind = type(value)
    if kind in _IMMUTABLE:
        return value
    done = memo.get(id(value))
    if done is not None:
        return done
    if kind is list and all(type(v) in _IMMUTABLE for v in value):
        out: Any = value.copy()
    elif kind is dict and all(type(k) in _IMMUTABLE and type(v) in _IMMUTABLE for k, v in value.items()):
        out = value.copy()
    else:
        return copy.deepcopy(value, memo)
    memo[id(value)] = out
    return out


SEGMENTS_KEY = "segments"
"""`sample.metadata` key of the segment list."""

EPISODE_METADATA_KEYS = (SEGMENTS_KEY, "termination", "turn_rewards", "env_metrics", "env_info", "agentic")
"""Metadata keys an agentic episode writes (`verst.rollout.agentic.episode`; "agentic" is its
`STATE_KEY`), removed when a sample is reset to its prompt."""


def segments_of(sample: Sample) -> list[dict[str, Any]]:
    """The sample's segments (an empty list for a sample without turns)."""
    return sample.metadata.get(SEGMENTS_KEY, [])


def trajectory_problems(sample: Sample) -> list[str]:
    """Broken multi-turn invariants of `sample` (empty when it has no segments or is fine)."""
    segments = segments_of(sample)
    if not segments:
        return []
    problems = []
    pos = 0
    mask = (
        sample.effective_loss_mask()
        if sample.loss_mask is None or len(sample.loss_mask) == sample.response_length
        else None
    )
    for k, seg in enumerate(segments):
        if seg["start"] != pos:
            problems.append(
                f"segment {k} starts at {seg['start']}, expected {pos} (segments must be contiguous)"
            )
        pos = seg["start"] + seg["length"]
        if mask is None:
            continue
        span = mask[seg["start"] : pos]
        if seg["source"] == "env" and any(span):
            problems.append(f"segment {k} (env) has loss mask 1 on injected tokens")
        if seg["source"] == "model" and seg["trainable"] and not all(span):
            problems.append(f"segment {k} (model, trainable) has loss mask 0")
        if seg["source"] == "model" and not seg["trainable"] and any(span):
            problems.append(f"segment {k} (model, masked) has loss mask 1")
    if pos != sample.response_length:
        problems.append(f"segments cover {pos} tokens, response_length={sample.response_length}")
    n_model = sum(1 for s in segments if s["source"] == "model")
    if len(sample.weight_versions) != n_model:
        problems.append(f"{len(sample.weight_versions)} weight_versions for {n_model} model segments")
    return problems
