"""Reading full trajectories out of a run: `read_trajectories` (the documented way, see
docs/dashboard.md), `turns`, and the dashboard's incremental `TrajectoryIndex`.

The format — one JSON object per line of `trajectories.jsonl` — is described in
`verst.trainer.run.trajectories`, which writes it.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from verst.trainer.dashboard.tail import JsonlTail
from verst.trainer.run.trajectories import TRAJECTORIES_FILE

__all__ = ["TRAJECTORIES_FILE", "TrajectoryIndex", "read_trajectories", "turns"]


def read_trajectories(
    run_dir: str | Path,
    *,
    step: int | None = None,
    split: str | None = None,
    sample_index: int | None = None,
) -> Iterator[dict[str, Any]]:
    """The full trajectories a run recorded (`trajectories.jsonl`), in file order, optionally only
    those of one `step`, `split` (`train`, `eval/<dataset>`) or `sample_index`.

    Lines that do not parse (a crash mid-write) are skipped. Each record is described in this
    module's docstring; `turns(record)` splits one into its segments with their text."""
    path = Path(run_dir) / TRAJECTORIES_FILE
    if not path.exists():
        return
    with path.open("rb") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            if step is not None and record.get("step") != step:
                continue
            if split is not None and record.get("split") != split:
                continue
            if sample_index is not None and record.get("sample_index") != sample_index:
                continue
            yield record


def turns(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The trajectory's response as segments, each with its ids, text, loss mask and log-probs:
    `[{"source", "turn", "start", "ids", "text", "loss_mask", "rollout_logprobs", ...}]`."""
    plen = int(record["prompt_length"])
    ids, texts = record["tokens"], record.get("token_text")
    out = []
    for seg in record.get("segments") or []:
        lo, hi = seg["start"], seg["start"] + seg["length"]

        def part(key: str, lo: int = lo, hi: int = hi) -> list[Any] | None:
            values = record.get(key)
            return None if values is None else values[lo:hi]

        out.append(
            {
                **seg,
                "ids": ids[plen + lo : plen + hi],
                "text": None if texts is None else "".join(texts[plen + lo : plen + hi]),
                "loss_mask": part("loss_mask"),
                "rollout_logprobs": part("rollout_logprobs"),
                "trainer_logprobs": part("trainer_logprobs"),
                "advantages": part("advantages"),
            }
        )
    return out


_HEAD = re.compile(
    rb'^\{"step": (-?\d+), "rollout_id": [^,]*, "split": "([^"\\]*)", "group_index": [^,]*, '
    rb'"sample_index": (-?\d+)'
)


class TrajectoryIndex:
    """`trajectories.jsonl` of a run indexed by (step, split, sample_index) -> byte offset, read
    incrementally like the other files (the dashboard's trajectory view). It has its own lock and
    is read when a view needs it, never by `RunData.refresh`: a large file of long trajectories
    never holds up the timeline."""

    def __init__(self, root: Path) -> None:
        self._lock = threading.Lock()
        self.tail = JsonlTail(root / TRAJECTORIES_FILE)
        self.offsets: dict[tuple[int, str], dict[int, int]] = {}
        """(step, split) -> sample_index -> byte offset of its line."""

    def read(self) -> int:
        """Index the lines the file gained; returns how many trajectories are indexed."""
        with self._lock:
            self._read()
            return sum(len(v) for v in self.offsets.values())

    def _read(self) -> None:
        for offset, line in self.tail.raw_lines():
            m = _HEAD.match(line)
            if m is not None:
                step, split, index = int(m.group(1)), m.group(2).decode("utf-8", "replace"), int(m.group(3))
            else:
                record = self.tail.parse(line)
                if record is None:
                    continue
                step, index = record.get("step"), record.get("sample_index")
                if not (isinstance(step, int) and isinstance(index, int)):
                    self.tail.count_malformed()
                    continue
                split = str(record.get("split", "train"))
            self.offsets.setdefault((step, split), {})[index] = offset  # a later line wins

    def keys_of(self, step: int, split: str) -> set[int]:
        """Sample indices of `step` and `split` that have a recorded trajectory."""
        with self._lock:
            return set(self.offsets.get((step, split), {}))

    def get(self, step: int, split: str, sample_index: int) -> dict[str, Any] | None:
        """The recorded trajectory, or None."""
        with self._lock:
            offset = self.offsets.get((step, split), {}).get(sample_index)
        if offset is None:
            return None
        try:
            with self.tail.path.open("rb") as fh:
                fh.seek(offset)
                record = json.loads(fh.readline())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None
