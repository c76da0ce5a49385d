"""Per-rollout metrics of agentic episodes (from what each sample's metadata records).

For the samples of a rollout (or an eval set) that ran an episode:
`<prefix>/turns_mean`, `<prefix>/turns_max`, `<prefix>/termination/<reason>` (fraction of
episodes), `<prefix>/env/<name>` (sums of the environments' step metrics, e.g. `tool_calls`,
`tool_errors`, `tool_timeouts`), `<prefix>/env/<name>_per_episode` and
`<prefix>/masked_model_tokens_frac` (model tokens loss-masked as off-policy).
"""

from __future__ import annotations

import statistics
from collections import Counter

from verst.rollout.agentic.trajectory import segments_of
from verst.rollout.sample import Sample


def agentic_metrics(samples: list[Sample], prefix: str) -> dict[str, float]:
    """The metrics above; empty when no sample ran an episode."""
    episodes = [s for s in samples if "termination" in s.metadata]
    if not episodes:
        return {}
    out: dict[str, float] = {}
    turns = [len({g["turn"] for g in segments_of(s) if g["source"] == "model"}) for s in episodes]
    out[f"{prefix}/turns_mean"] = statistics.fmean(turns)
    out[f"{prefix}/turns_max"] = float(max(turns))
    reasons = Counter(str(s.metadata["termination"]) for s in episodes)
    for reason, count in reasons.items():
        out[f"{prefix}/termination/{reason}"] = count / len(episodes)
    totals: Counter[str] = Counter()
    for s in episodes:
        totals.update({k: float(v) for k, v in s.metadata.get("env_metrics", {}).items()})
    for name, value in totals.items():
        out[f"{prefix}/env/{name}"] = value
        out[f"{prefix}/env/{name}_per_episode"] = value / len(episodes)
    model = masked = 0
    for s in episodes:
        for g in segments_of(s):
            if g["source"] == "model":
                model += g["length"]
                masked += 0 if g["trainable"] else g["length"]
    out[f"{prefix}/masked_model_tokens_frac"] = masked / model if model else 0.0
    return out
