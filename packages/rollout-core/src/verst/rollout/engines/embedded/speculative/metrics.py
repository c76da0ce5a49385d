"""Speculative decoding's per-rollout metrics from the engines' counters (light: no torch).

`speculative_counters(engine)` sums `speculative_stats` over an engine or an `EnginePool`'s
engines (None when no engine speculates); `speculative_metrics(before, after)` turns the
difference over one rollout into `rollout/speculative/*`:
`acceptance_rate` (accepted / proposed tokens), `accepted_len` (mean tokens a proposing row
emitted per verification step: accepted + the drawn one), `proposed_per_step`,
`plain_step_fraction` (steps where plain decoding ran), `speculated_fraction` (steps that
verified proposals) and `gated_fraction` (steps the cost gate sent to plain decoding).
"""

from __future__ import annotations

from typing import Any


def speculative_counters(engine: Any) -> dict[str, float] | None:
    """The summed counters of `engine` (or of its pool's engines); None: nothing speculates."""
    parts = [getattr(e, "speculative_stats", None) for e in getattr(engine, "engines", [engine])]
    stats = [p for p in parts if isinstance(p, dict)]
    if not stats:
        return None
    return {k: sum(s.get(k, 0.0) for s in stats) for k in stats[0]}


def speculative_metrics(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """`rollout/speculative/*` over the interval between two `speculative_counters` readings."""
    if after is None:
        return {}
    d = {k: v - (before or {}).get(k, 0.0) for k, v in after.items()}
    out: dict[str, float] = {}
    if d["proposed"] > 0:
        out["rollout/speculative/acceptance_rate"] = d["accepted"] / d["proposed"]
    if d["rows"] > 0:
        out["rollout/speculative/accepted_len"] = (d["accepted"] + d["rows"]) / d["rows"]
    if d["steps"] > 0:
        out["rollout/speculative/proposed_per_step"] = d["proposed"] / d["steps"]
    if d["steps"] + d["plain_steps"] > 0:
        total = d["steps"] + d["plain_steps"]
        out["rollout/speculative/plain_step_fraction"] = d["plain_steps"] / total
        out["rollout/speculative/speculated_fraction"] = d["steps"] / total
        out["rollout/speculative/gated_fraction"] = d.get("gated", 0.0) / total
    return out
