"""Per-row sampling over a batch of logits: temperature, top-k, top-p, per-request seeds.

Every row carries its own settings, so one decode step serves requests with different
sampling parameters. The log-prob reported for a sampled token is `log_softmax(logits / T)`
(T = 0 counts as 1) *before* top-k/top-p truncation, computed in float32 — what SGLang returns
and what the trainer recomputes.

Sampling uses the exponential race (`argmax(p / E)`, `E ~ Exp(1)`), which draws exactly one
fixed-size noise vector per row and step: a seeded request draws its noise from its own
`torch.Generator`, so its tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class RowSampling:
    """The sampling settings of one row, resolved for the decode loop."""

    temperature: float
    """Softmax temperature; 0 = greedy."""
    top_p: float
    """Nucleus mass in (0, 1]."""
    top_k: int
    """Top-k (-1 = all)."""
    generator: Any
    """A seeded `torch.Generator`, or None for the engine's shared RNG."""


@dataclass(slots=True)
class BatchSampling:
    """Sampling settings of a whole batch as tensors (rebuilt only when the batch changes)."""

    rows: list[RowSampling]
    """One entry per row."""
    inv_temp: torch.Tensor  # [batch, 1]
    """1 / T per row (T = 0 → 1)."""
    greedy: torch.Tensor  # [batch] bool
    """Rows decoded greedily."""
    top_k: torch.Tensor  # [batch, 1] long
    """Per-row k (vocab size for 'all')."""
    top_p: torch.Tensor  # [batch, 1]
    """Per-row nucleus mass."""
    all_greedy: bool
    """No row samples."""
    truncate: bool
    """Some row uses top-k or top-p."""
    noise: torch.Tensor | None = None  # [batch, vocab] float32
    """The noise buffer, refilled every step (None when no row samples)."""
    seeded: list[tuple[torch.Tensor, Any]] = field(default_factory=list)
    """(row of `noise`, generator) of every seeded row, built once per batch layout."""

    @classmethod
    def build(cls, rows: list[RowSampling], vocab_size: int, device: Any) -> BatchSampling:
        temps = [r.temperature for r in rows]
        inv_temp = torch.tensor([1.0 / t if t > 0 else 1.0 for t in temps], device=device)[:, None]
        greedy = torch.tensor([t <= 0 for t in temps], device=device)
        ks = [r.top_k if 0 < r.top_k < vocab_size else vocab_size for r in rows]
        top_k = torch.tensor(ks, device=device)[:, None]
        top_p = torch.tensor([r.top_p for r in rows], device=device)[:, None]
        sampling = [r for r in rows if r.temperature > 0]
        truncate = any(r.top_p < 1.0 or 0 < r.top_k < vocab_size for r in sampling)
        noise = torch.empty((len(rows), vocab_size), device=device) if sampling else None
        seeded = _seeded_rows(noise, rows) if noise is not None else []
        return cls(rows, inv_temp, greedy, top_k, top_p, not sampling, truncate, noise, seeded)


def _seeded_rows(noise: torch.Tensor, rows: list[RowSampling]) -> list[tuple[torch.Tensor, Any]]:
    return [(noise[i], r.generator) for i, r in enumerate(rows) if r.generator is not None]


def logprobs_of(logits: torch.Tensor, inv_temp: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits / T)` in float32.  logits: [batch, vocab] → [batch, vocab]."""
    return torch.log_softmax(logits.float() * inv_temp, dim=-1)


def _truncate(logprobs: torch.Tensor, s: BatchSampling) -> torch.Tensor:
    """Mask tokens outside each row's top-k / top-p set with -inf.  [batch, vocab]."""
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)  # [batch, vocab]
    vocab = logprobs.shape[-1]
    ranks = torch.arange(vocab, device=logprobs.device)[None, :]  # [1, vocab]
    drop = ranks >= s.top_k
    cum = torch.cumsum(sorted_lp.exp(), dim=-1)  # [batch, vocab]
    drop |= (cum - sorted_lp.exp()) >= s.top_p  # keep the smallest prefix reaching top_p
    drop[:, 0] = False
    sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
    return torch.empty_like(logprobs).scatter_(-1, order, sorted_lp)


def sample(logits: torch.Tensor, s: BatchSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    logits: [batch, vocab]. Returns (tokens [batch] long, logprobs [batch, vocab] float32),
    where logprobs are the untruncated `log_softmax(logits / T)`.
    """
    logprobs = logprobs_of(logits, s.inv_temp)  # [batch, vocab]
    if s.all_greedy:
        return logprobs.argmax(dim=-1), logprobs
    scores = _truncate(logprobs, s) if s.truncate else logprobs
    noise, seeded = s.noise, s.seeded  # [batch, vocab]; the same draws as a fresh tensor
    if noise is None or noise.shape != scores.shape or noise.dtype != scores.dtype:
        noise = torch.empty_like(scores)
        seeded = _seeded_rows(noise, s.rows)
    if len(seeded) < len(s.rows):
        noise.exponential_()
    for row, generator in seeded:
        row.exponential_(generator=generator)
    tokens = (scores - noise.log()).argmax(dim=-1)  # [batch]
    if s.greedy.any():
        tokens = torch.where(s.greedy, logprobs.argmax(dim=-1), tokens)
    return tokens, logprobs


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """Top-k (log-prob, token id) pairs per row.  logprobs: [rows, vocab]."""
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]


def ids_logprobs(logprobs: torch.Tensor, token_ids: list[int]) -> list[list[tuple[float, int]]]:
    """(log-prob, token id) of the given ids per row.  logprobs: [rows, vocab]."""
    index = torch.tensor(token_ids, device=logprobs.device)
    values = logprobs.index_select(-1, index).tolist()  # [rows, len(ids)]
    return [list(zip(v, token_ids, strict=True)) for v in values]
