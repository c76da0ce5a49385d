"""The samples table's query: text search, status and reward-range filters, sort by any column.

The served page asks the server (`SampleQuery` from the URL); the report's page applies the same
rules to its embedded rows (`app.js`, `querySamples`), and the browser tests check both.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SORT_KEYS = (
    "sample",
    "group",
    "status",
    "reward",
    "advantage",
    "tokens",
    "response_tokens",
    "weight_version",
    "label",
)
"""Columns the table sorts by (`sort=`); the default order is by sample index."""


@dataclass(frozen=True, slots=True)
class SampleQuery:
    """Which rows of a step's samples, in which order."""

    text: str = ""
    """Case-insensitive substring of prompt, response, label, error, status or reward."""
    sort: str = ""
    """One of `SORT_KEYS` ("" = by sample index)."""
    desc: bool = False
    statuses: tuple[str, ...] = ()
    """Keep only these statuses (empty = all)."""
    reward_min: float | None = None
    """Keep rows whose scalar reward is >= this (rows without one are dropped when a bound is set)."""
    reward_max: float | None = None

    def __post_init__(self) -> None:
        if self.sort and self.sort not in SORT_KEYS:
            raise ValueError(f"cannot sort by {self.sort!r}; valid columns: {', '.join(SORT_KEYS)}")


def scalar_reward(record: dict[str, Any], reward_key: str | None = None) -> float | None:
    """The row's reward as one number: the reward, or `reward[reward_key]` (else its first number)."""
    reward = record.get("reward")
    if isinstance(reward, dict):
        if reward_key is not None and isinstance(reward.get(reward_key), int | float):
            reward = reward[reward_key]
        else:
            reward = next((v for v in reward.values() if isinstance(v, int | float)), None)
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        return None
    return float(reward)


def _key(record: dict[str, Any], column: str, reward_key: str | None) -> Any:
    if column == "group":
        return record.get("group_index")
    if column == "status":
        return record.get("status")
    if column == "reward":
        return scalar_reward(record, reward_key)
    if column == "advantage":
        return record.get("advantage")
    if column == "tokens":
        return (record.get("prompt_tokens") or 0) + (record.get("response_tokens") or 0)
    if column == "response_tokens":
        return record.get("response_tokens")
    if column == "weight_version":
        versions = record.get("weight_versions") or []
        return max(versions) if versions else None
    if column == "label":
        return record.get("label")
    return record.get("sample_index")


def search_text(record: dict[str, Any]) -> str:
    """What the text search looks in, lower-cased."""
    parts = [record.get(k) for k in ("prompt", "response", "label", "error", "status")]
    parts.append(json.dumps(record.get("reward")))
    return " ".join(str(p) for p in parts if p is not None).lower()


def query_samples(
    records: Sequence[dict[str, Any]], query: SampleQuery, *, reward_key: str | None = None
) -> list[dict[str, Any]]:
    """The rows `query` keeps, in its order (rows without a value sort last either way)."""
    rows = list(records)
    if query.text:
        q = query.text.lower()
        rows = [r for r in rows if q in search_text(r)]
    if query.statuses:
        rows = [r for r in rows if r.get("status") in query.statuses]
    if query.reward_min is not None or query.reward_max is not None:
        lo = query.reward_min if query.reward_min is not None else float("-inf")
        hi = query.reward_max if query.reward_max is not None else float("inf")
        rows = [r for r in rows if (v := scalar_reward(r, reward_key)) is not None and lo <= v <= hi]
    column = query.sort or "sample"
    present = [r for r in rows if _key(r, column, reward_key) is not None]
    missing = [r for r in rows if _key(r, column, reward_key) is None]
    present.sort(key=lambda r: (_key(r, column, reward_key), r.get("sample_index") or 0), reverse=query.desc)
    return present + missing
