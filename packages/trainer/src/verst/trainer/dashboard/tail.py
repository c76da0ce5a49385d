"""`JsonlTail`: read the complete lines a growing JSON-lines file gained since the last read.

A run appends to its files while the dashboard reads them, so a read can end inside a line; that
partial line is kept back until its newline arrives. A line that does not parse (or is not an
object) is skipped and counted — a crash mid-write, a disk-full truncation or a hand edit never
stops the dashboard. A file that shrank (rewritten) is read again from the start.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

READ_CHUNK = 8 << 20
"""Bytes read per system call."""


class JsonlTail:
    """Incremental reader of one JSONL file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        """Bytes consumed (complete lines only)."""
        self.lines = 0
        """Complete lines seen."""
        self.malformed = 0
        """Lines skipped because they are not a JSON object."""
        self.first_malformed_line: int | None = None
        """1-based line number of the first skipped line."""
        self.partial = False
        """The file ends inside a line (still being written, or truncated)."""
        self._ino: int | None = None

    def reset_needed(self) -> bool:
        """The file was replaced or shrank since the last read (callers start over)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return self.offset > 0
        return (self._ino is not None and st.st_ino != self._ino) or st.st_size < self.offset

    def raw_lines(self) -> Iterator[tuple[int, bytes]]:
        """(byte offset, line without newline) of each complete line added since the last call."""
        try:
            fh = self.path.open("rb")
        except FileNotFoundError:
            return
        with fh:
            self._ino = os.fstat(fh.fileno()).st_ino
            fh.seek(self.offset)
            carry = b""
            while chunk := fh.read(READ_CHUNK):
                buf = carry + chunk if carry else chunk
                pos, start = 0, self.offset
                while (end := buf.find(b"\n", pos)) >= 0:
                    self.lines += 1
                    yield start + pos, buf[pos:end]
                    pos = end + 1
                self.offset = start + pos
                carry = buf[pos:]
            self.partial = bool(carry.strip())

    def records(self) -> Iterator[dict[str, Any]]:
        """Each new complete line parsed as a JSON object; bad lines are counted and skipped."""
        for _, line in self.raw_lines():
            record = self.parse(line)
            if record is not None:
                yield record

    def parse(self, line: bytes) -> dict[str, Any] | None:
        """One line as a JSON object, or None (counted as malformed; blank lines are ignored)."""
        if not line.strip():
            return None
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            self.count_malformed()
            return None
        return record

    def count_malformed(self) -> None:
        """Count the line just read as malformed."""
        self.malformed += 1
        if self.first_malformed_line is None:
            self.first_malformed_line = self.lines

    def health(self, *, extra_malformed: int = 0) -> dict[str, Any]:
        """Line counts for the overview (`extra_malformed`: bad lines a caller found later)."""
        return {
            "file": self.path.name,
            "lines": self.lines,
            "malformed": self.malformed + extra_malformed,
            "first_malformed_line": self.first_malformed_line,
            "partial_last_line": self.partial,
        }


def head_int(line: bytes, key: bytes) -> int | None:
    """The integer after `key` (e.g. `b'"rollout_id": '`) near a line's head, read without
    parsing the line; None when it is not there or not an integer (the caller parses the line)."""
    i = line.find(key, 0, 160)
    if i < 0:
        return None
    j = i + len(key)
    end = line.find(b",", j, j + 24)
    try:
        return int(line[j:end]) if end > j else None
    except ValueError:
        return None
