"""Prompt lookup (n-gram) proposals: no extra model.

A row's context (prompt + output so far) is searched for the most recent earlier occurrence of
its last `n` tokens, longest `n` first (`max_ngram` down to `min_ngram`); the tokens that
followed it are the proposal. Strong where the output copies its context: tool outputs quoted
back, code edits, reversing or repeating a sequence. The proposal is a point mass (`q = δ`).
Where the matched continuation reaches the end of the context (a loop shorter than `k`), the
proposal repeats it (`_continuation`). Each row keeps an index of where every token occurs
(`NgramIndex`, extended as it grows), so a lookup reads the positions of its last token only,
not the whole context.

Ties: among matches of the same length, one whose `k` continuation tokens end before the
matched suffix begins beats one whose continuation runs into that suffix (reads the very tokens
being matched: a claim that the context is periodic with a period under `n + k`, on the same
`n` tokens of evidence as a plain copy); a loop still gets its periodic proposal when nothing
else matches as long. Below `max_ngram`, where several matches remain equally good, the
proposal is what their continuations agree on (their longest common prefix, maybe nothing: then
the row decodes plainly this step and the next, one token longer, suffix usually tells them
apart); a clear match of `max_ngram` tokens is taken as it is (the latest). Where it mattered:
tool_math's answer copies the observation, e.g. `85428`; after its first `8` the latest 1-gram
match, the observation's last `8`, was followed by `</tool_response> 8` (the suffix itself) and
proposed the closing tag, rejected; with an answer like `979493` the first `9` also matches
the observation's other `9`s (and any in the prompt), whose continuations disagree: a verify
step lost per answer, and the gate, seeing the row fail, ran its rest plain
(`benchmarks/speculative.py --tasks tool_math`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class NgramIndex:
    """Positions of every token of one row's context, in order."""

    tokens: list[int] = field(default_factory=list)
    at: dict[int, list[int]] = field(default_factory=dict)

    prompt_len: int = -1

    def extend(self, prompt: list[int], output: list[int]) -> None:
        """Index the tokens of `prompt + output` past those seen (the context only ever grows)."""
        if self.prompt_len < 0:
            self.prompt_len = len(prompt)
            self._add(prompt)
        self._add(output[len(self.tokens) - self.prompt_len :])

    def _add(self, tokens: list[int]) -> None:
        for tok in tokens:
            self.at.setdefault(tok, []).append(len(self.tokens))
            self.tokens.append(tok)

    def lookup(self, min_n: int, max_n: int, k: int, max_candidates: int = 64) -> list[int]:
        """Up to `k` tokens that followed the best earlier match of the suffix (see the module
        doc: the longest; then clear of the suffix; below `max_n`, what all such agree on)."""
        ctx, end = self.tokens, len(self.tokens)
        if k <= 0 or end < min_n + 1:
            return []
        best_key = (min_n - 1, False)
        tied: list[int] = []  # the candidates of the best key, latest first
        places = self.at.get(ctx[-1], [])
        for j in reversed(places[-max_candidates - 1 : -1]):  # j: an earlier occurrence of the last token
            n = 1
            while n < max_n and j - n >= 0 and ctx[j - n] == ctx[end - 1 - n]:
                n += 1
            key = (n, j + 1 + k <= end - n)  # longer first; then a continuation clear of the suffix
            if key > best_key:
                best_key, tied = key, [j]
                if key == (max_n, True):
                    break
            elif key == best_key:
                tied.append(j)
        if best_key[0] < min_n:
            return []
        best = _continuation(ctx, tied[0], k)
        for j in tied[1:]:  # equally good evidence: propose only what it agrees on
            other = _continuation(ctx, j, len(best))
            m = 0
            while m < len(best) and best[m] == other[m]:
                m += 1
            del best[m:]
            if not best:
                break
        return best


def _continuation(ctx: list[int], j: int, k: int) -> list[int]:
    """Up to `k` tokens following position `j` of `ctx`, the n-gram ending at `j` matching the
    context's suffix. Where they run into the end of the context the match says the context is
    periodic there (period `len(ctx) - 1 - j`: the suffix repeats what followed `j`), so the
    proposal continues the period: in a loop of `p` tokens (`p < k`) it proposes `k` tokens, not
    `p`."""
    period = len(ctx) - 1 - j
    if j + 1 + k <= len(ctx):
        return ctx[j + 1 : j + 1 + k]
    return [ctx[j + 1 + i % period] for i in range(k)]


class NgramProposer:
    """Proposes continuations found in each row's own context (see the module doc)."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def propose(self, batch: Any, rows: list[Any], caps: list[int]) -> tuple[list[list[int]], Any]:
        """Per row up to `caps[i]` proposed tokens, and None (point masses)."""
        out: list[list[int]] = []
        for r, cap in zip(rows, caps, strict=True):
            if cap <= 0:
                out.append([])
                continue
            state = r.spec
            if state.index is None:
                state.index = NgramIndex()
            idx = state.index
            idx.extend(r.request.input_ids, r.output_ids)
            out.append(idx.lookup(self.min_ngram, self.max_ngram, cap))
        return out, None

    def refit(self, named: dict[str, Any]) -> None:
        """No weights."""
