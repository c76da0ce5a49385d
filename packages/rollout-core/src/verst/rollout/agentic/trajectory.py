"""Building a multi-turn trajectory: one `Sample` per episode, turns added only by `append_turn`.

The sample's response (everything after the prompt) is a sequence of **segments**, recorded in
`sample.metadata["segments"]` (response-relative, in order, covering the response exactly):

    {"source": "model" | "env", "start": int, "length": int, "turn": int,
     "weight_version": int | None, "trainable": bool}

- model segments hold the exact ids the engine generated; loss mask 1 (0 when masked as
  off-policy), `rollout_logprobs` the engine's log-probs;
- env segments hold observation ids exactly as they were fed to the engine; loss mask 0,
  `rollout_logprobs` = `MASKED_LOGPROB`;
- `sample.weight_versions` gets one entry per model segment (per engine request), and
  `sample.token_versions` one per response token (a model token: its request's version; an
  injected token: the version of the last model token before it, -1 before the first; an
  empty model turn generated nothing, so it lends its version to no injected token).

- `sample.routed_experts` (MoE engines asked to `return_routed_experts`) covers every position but
  the last: a model turn adds the rows its engine call returned, an env segment adds rows of -1
  (observation tokens carry no routing: the trainer's routers choose freely there). A model turn
  without routing, or whose rows do not line up with the tokens, drops the sample's routing.


`trajectory_problems` (defined with `Sample`, in `verst.rollout.sample`, and re-exported here) checks
these invariants; `Sample.validate` calls it for samples that carry segments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from verst.rollout.moe import RoutedExperts, extend_routing
from verst.rollout.sample import SEGMENTS_KEY, Sample, segments_of, trajectory_problems

MASKED_LOGPROB = 0.0
"""`rollout_logprobs` value on injected (non-model) tokens; never trained on (loss mask 0)."""

__all__ = [
    "MASKED_LOGPROB",
    "SEGMENTS_KEY",
    "append_turn",
    "generated_token_count",
    "mask_turns_before",
    "model_token_positions",
    "segments_of",
    "trajectory_problems",
]

Source = Literal["model", "env"]


def append_turn(
    sample: Sample,
    ids: Sequence[int],
    logprobs: Sequence[float] | None,
    trainable: bool,
    weight_version: int | None = None,
    *,
    source: Source | None = None,
    text: str | None = None,
    turn: int | None = None,
    routed_experts: RoutedExperts | None = None,
    routed_start: int = 0,
) -> None:
    """Append one turn's tokens to `sample` — the only way turns are added.

    `ids`: the exact token ids (model output as generated, or an observation tokenized once).
    `logprobs`: the engine's log-prob per id (model turns); None for injected tokens, or for a
    model turn the engine gave none for (then the sample's `rollout_logprobs` become None).
    `trainable`: loss mask value for these ids (model tokens: True unless masked off-policy;
    injected tokens: always False). `weight_version`: the engine weight version of a model turn.
    `source` defaults to "model" when a `weight_version` is given, else "env". `text` is appended to
    `sample.response`. `turn` is the model-turn index (default: the number of model turns so far
    for model tokens, the last one for env tokens).
    """
    ids = list(ids)
    source = _turn_source(source, len(ids), logprobs, trainable, weight_version)
    segments = sample.metadata.setdefault(SEGMENTS_KEY, [])
    if not segments and sample.response_length:
        raise ValueError(
            "append_turn on a sample whose response was built without it "
            f"(response_length={sample.response_length}, no segments)"
        )
    model_turns = sum(1 for s in segments if s["source"] == "model")
    if turn is None:
        turn = model_turns if source == "model" else max(model_turns - 1, 0)
    start = sample.response_length
    previous_mask = sample.effective_loss_mask()
    sample.loss_mask = previous_mask + [int(trainable)] * len(ids)
    _extend_versions(sample, ids, source, logprobs, weight_version, segments)
    _extend_routing(sample, ids, source, routed_experts, routed_start)
    sample.tokens = [*sample.tokens, *ids]
    sample.response_length = start + len(ids)
    if text:
        sample.response += text
    segments.append(
        {
            "source": source,
            "start": start,
            "length": len(ids),
            "turn": turn,
            "weight_version": None if weight_version is None else int(weight_version),
            "trainable": bool(trainable),
        }
    )


def _turn_source(
    source: Source | None,
    n: int,
    logprobs: Sequence[float] | None,
    trainable: bool,
    weight_version: int | None,
) -> Source:
    """The turn's source ("model" or "env", defaulted as `append_turn` says), its arguments checked."""
    if source is None and trainable and weight_version is None:
        raise ValueError("a model turn needs the weight_version it was generated with")
    source = source or ("model" if weight_version is not None else "env")
    if source not in ("model", "env"):
        raise ValueError(f"source must be 'model' or 'env', got {source!r}")
    if source == "env" and trainable:
        raise ValueError("injected (env) tokens are never trainable: pass trainable=False")
    if logprobs is not None and len(logprobs) != n:
        raise ValueError(f"{len(logprobs)} log-probs for {n} ids")
    if source == "model" and weight_version is None:
        raise ValueError("a model turn needs the weight_version it was generated with")
    return source


def _extend_versions(
    sample: Sample,
    ids: list[int],
    source: Source,
    logprobs: Sequence[float] | None,
    weight_version: int | None,
    segments: list[dict[str, Any]],
) -> None:
    """The rollout log-probs, weight versions and per-token versions of the appended `ids`
    (before `sample.response_length` moves past them)."""
    start = sample.response_length
    if source == "model":
        if logprobs is None or (sample.rollout_logprobs is None and start > 0):
            sample.rollout_logprobs = None
        else:
            sample.rollout_logprobs = [*(sample.rollout_logprobs or []), *map(float, logprobs)]
        sample.weight_versions = [*sample.weight_versions, int(weight_version)]  # type: ignore[arg-type]
    elif sample.rollout_logprobs is not None or start == 0:
        sample.rollout_logprobs = [*(sample.rollout_logprobs or []), *[MASKED_LOGPROB] * len(ids)]
    if start == 0:
        sample.token_versions = []
    if sample.token_versions is not None:  # per token: the version of the call that made it,
        # or for injected tokens the last generated token's (-1 before the first model token)
        previous = [s["weight_version"] for s in segments if s["source"] == "model" and s["length"]]
        version = weight_version if source == "model" else (previous[-1] if previous else -1)
        sample.token_versions = [*sample.token_versions, *[int(version)] * len(ids)]  # type: ignore[arg-type]


def _extend_routing(
    sample: Sample, ids: list[int], source: str, routed: RoutedExperts | None, routed_start: int
) -> None:
    """The routing rows of a turn (before its ids join `sample.tokens`)."""
    current = sample.routed_experts
    after = len(sample.tokens) + len(ids) - 1
    if source == "env":
        if current is not None and ids:
            sample.routed_experts = current.concat(RoutedExperts.unrecorded(len(ids), current.width))
        return
    covered = current.tokens if current is not None else 0
    joined = extend_routing(current, routed, routed_start, covered)
    sample.routed_experts = joined if joined is not None and joined.tokens == after else None


def mask_turns_before(sample: Sample, weight_version: int) -> int:
    """Loss-mask every model segment generated under a weight version older than
    `weight_version` (partial rollout with `mask_offpolicy_in_partial_rollout`); returns the
    number of tokens newly masked."""
    mask = sample.effective_loss_mask()
    masked = 0
    for seg in segments_of(sample):
        if seg["source"] == "model" and seg["trainable"] and seg["weight_version"] < weight_version:
            seg["trainable"] = False
            for i in range(seg["start"], seg["start"] + seg["length"]):
                masked += mask[i]
                mask[i] = 0
    sample.loss_mask = mask
    return masked


def generated_token_count(sample: Sample) -> int:
    """Tokens the engine generated for `sample` (observations excluded)."""
    segments = segments_of(sample)
    if not segments:
        return sample.response_length
    return sum(s["length"] for s in segments if s["source"] == "model")


def model_token_positions(sample: Sample) -> list[int]:
    """Response-relative positions of every model-generated token, in order."""
    return [
        i
        for seg in segments_of(sample)
        if seg["source"] == "model"
        for i in range(seg["start"], seg["start"] + seg["length"])
    ]
