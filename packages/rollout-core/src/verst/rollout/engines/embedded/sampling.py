"""Per-row sampling over a batch of logits: temperature, top-k, top-p, per-request seeds.

Every row carries its own settings, so one decode step serves requests with different
sampling parameters. The log-prob reported for a sampled token is `log_softmax(logits / T)`
(T = 0 counts as 1) *before* top-k/top-p truncation, computed in float32 — what SGLang returns
and what the trainer recomputes.

Sampling inverts each row's CDF at one uniform draw per row and step. A seeded request's draw is
a hash of its seed and the position of the token being drawn (`seeded_uniforms`), as SGLang
seeds by (seed, position): its tokens do not depend on which other requests share the batch or
on when it was admitted, and a whole step's seeded rows draw in a dozen tensor operations
instead of one generator call each. The CDF is two-level (sums of `BLOCK`-token blocks, then
the cumulative sum inside the chosen block): it reads the probabilities about twice instead of
drawing a noise value per vocabulary entry (at a 49k vocabulary the noise was most of a step's
sampling time), and keeps every float32 running sum short.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    seed: int | None = None
    """The request's `sampling_seed` (any int, taken mod 2⁶⁴), or None for the engine's shared RNG."""


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
    unit_temp: bool = False
    """Every row's 1 / T is 1 (T = 1 or greedy): logits need no scaling."""
    greedy_rows: torch.Tensor | None = None  # [greedy] long
    """Indices of the greedy rows when some (not all) rows are greedy."""
    seeded_rows: torch.Tensor | None = None  # [seeded] long
    """Indices of the seeded sampling rows (None when there are none)."""
    seed_keys: torch.Tensor | None = None  # [seeded] long, each in [0, 2³²)
    """Their seeds hashed to 32 bits (`seed_key`), in the same order."""
    probs: torch.Tensor | None = None  # [batch, blocks * BLOCK] float32
    """Scratch for the probabilities, zero past the vocabulary (None when no row samples)."""

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
        some_greedy = [i for i, t in enumerate(temps) if t <= 0]
        greedy_rows = torch.tensor(some_greedy, device=device) if some_greedy and sampling else None
        seeded = [i for i, r in enumerate(rows) if r.seed is not None and r.temperature > 0]
        seeded_rows = torch.tensor(seeded, device=device) if seeded else None
        seed_keys = torch.tensor([seed_key(rows[i].seed) for i in seeded], device=device) if seeded else None
        probs = None
        if sampling:
            probs = torch.zeros((len(rows), _blocks(vocab_size) * _block(vocab_size)), device=device)
        return cls(
            rows,
            inv_temp,
            greedy,
            top_k,
            top_p,
            not sampling,
            truncate,
            all(t <= 0 or t == 1.0 for t in temps),
            greedy_rows,
            seeded_rows,
            seed_keys,
            probs,
        )


BLOCK = 256
"""Tokens per block of the two-level CDF."""


def _block(vocab: int) -> int:
    return min(BLOCK, vocab)


def _blocks(vocab: int) -> int:
    return -(-vocab // _block(vocab))


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


_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B
"""The multiplier of the 32-bit integer finaliser `_mix` (under 2²⁷: a product of it and a 32-bit
value stays inside int64, so the tensor arithmetic never overflows)."""


def _mix(x: Any) -> Any:
    """A 32-bit integer hash with full avalanche (xor-shift, multiply, twice), on Python ints or
    int64 tensors holding values in [0, 2³²)."""
    x = ((x >> 16) ^ x) * _MIX & _M32
    x = ((x >> 16) ^ x) * _MIX & _M32
    return (x >> 16) ^ x


def seed_key(seed: int) -> int:
    """A request seed (any int, taken mod 2⁶⁴) hashed to 32 bits: both halves count."""
    seed &= (1 << 64) - 1
    return _mix((seed & _M32) ^ _mix(seed >> 32))


_WEYL = 0x9E3779B9
"""2³² / φ: consecutive positions step a seed's state by it (SplitMix's Weyl sequence)."""


def seeded_uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One draw in (0, 1] per seeded row: `_mix(key + position · 2³²/φ)`, SplitMix's construction
    with the seed's key as the start of its sequence, at the sequence position of the token it
    draws (24 bits, the resolution of `torch.rand` in float32).
    keys, positions: [rows] long, positions < 2³¹ → [rows] float32."""
    h = _mix((positions * _WEYL + keys) & _M32)
    return ((h >> 8) + 1).float() * 2.0**-24


def _uniforms(s: BatchSampling, n: int, device: Any, positions: torch.Tensor | None) -> torch.Tensor:
    """One draw in (0, 1] per row, seeded rows' from (seed, position).  → [batch, 1]."""
    u = 1.0 - torch.rand((n, 1), device=device)
    if s.seeded_rows is not None:
        if positions is None:
            raise ValueError("seeded rows draw by position: pass the positions of the tokens drawn")
        u[s.seeded_rows, 0] = seeded_uniforms(s.seed_keys, positions[s.seeded_rows])
    return u


def _invert_cdf(
    scores: torch.Tensor, s: BatchSampling, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A token per row from `softmax(scores)` at one uniform draw, and each row's
    `logsumexp(scores)`.  scores: [batch, vocab] (-inf = excluded) → ([batch] long, [batch, 1]).
    The probabilities are `exp(scores − row max)`, unnormalised (the draw is scaled by their
    total), so the log-sum-exp comes from the same pass: `max + log(total)`. Only tokens of
    positive probability can come out: the draw lands in (cdf[i-1], cdf[i]] of exactly one
    token i (its block searched first)."""
    n, vocab = scores.shape
    blk, nb = _block(vocab), _blocks(vocab)
    top = scores.amax(-1, keepdim=True)  # [batch, 1]
    if nb == 1:  # a vocabulary of one block: the plain CDF (the same inversion, fewer operations)
        cdf = (scores - top).exp_().cumsum(-1)  # [batch, vocab]
        x = _uniforms(s, n, scores.device, positions) * cdf[:, -1:]  # [batch, 1], in (0, total]
        return torch.searchsorted(cdf, x)[:, 0].clamp_(max=vocab - 1), top + cdf[:, -1:].log()
    probs = s.probs
    if probs is None or probs.shape != (n, nb * blk) or probs.device != scores.device:
        probs = torch.zeros((n, nb * blk), device=scores.device)
    torch.sub(scores, top, out=probs[:, :vocab]).exp_()  # the padding past the vocabulary stays 0
    blocks = probs.view(n, nb, blk)  # [batch, blocks, blk]
    cum = blocks.sum(-1).cumsum(-1)  # [batch, blocks]
    x = _uniforms(s, n, scores.device, positions) * cum[:, -1:]  # [batch, 1], in (0, total]
    b = torch.searchsorted(cum, x).clamp_(max=nb - 1)  # [batch, 1]: first block with cum >= x
    before = torch.where(b > 0, cum.gather(-1, (b - 1).clamp(min=0)), torch.zeros_like(x))
    inner = blocks.gather(1, b[:, :, None].expand(n, 1, blk))[:, 0].cumsum(-1)  # [batch, blk]
    y = torch.minimum(x - before, inner[:, -1:])  # > 0, since x lies past the earlier blocks
    j = torch.searchsorted(inner, y).clamp_(max=blk - 1)  # [batch, 1]
    # a NaN row (never a live one) stays in range
    return (b * blk + j)[:, 0].clamp_(max=vocab - 1), top + cum[:, -1:].log()


@dataclass(frozen=True, slots=True)
class StepScores:
    """One step's `logits / T` per row and their log-sum-exp: `log_softmax` on demand.

    A step needs the log-probs of the sampled tokens only (plus whole rows for the requests that
    ask for top-k or chosen ids), so the `[batch, vocab]` log-probs are not formed: each is
    `scores − lse`. The log-sum-exp comes from the sampler's own pass (`_invert_cdf`)."""

    scores: torch.Tensor  # [batch, vocab] float32
    lse: torch.Tensor  # [batch, 1] float32

    def of(self, tokens: torch.Tensor) -> torch.Tensor:
        """The log-prob of `tokens` ([batch] long), one per row → [batch]."""
        return self.scores.gather(-1, tokens[:, None])[:, 0] - self.lse[:, 0]

    def rows(self, index: Any = slice(None)) -> torch.Tensor:
        """The whole log-prob rows `index` (default: every row) → [rows, vocab]."""
        return self.scores[index] - self.lse[index]


def sample(
    logits: torch.Tensor, s: BatchSampling, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, StepScores]:
    """Pick one token per row.

    logits: [batch, vocab]; positions: [batch] long, the sequence position of the token each row
    draws (needed when some row is seeded). Returns (tokens [batch] long, the step's
    `StepScores`), whose log-probs are the untruncated `log_softmax(logits / T)`.
    """
    # [batch, vocab] float32; unit temperatures skip the scaling pass (never written in place)
    scores = logits.float() if s.unit_temp else logits.float() * s.inv_temp
    if s.all_greedy:
        return scores.argmax(dim=-1), StepScores(scores, torch.logsumexp(scores, -1, keepdim=True))
    if s.truncate:
        lse = torch.logsumexp(scores, -1, keepdim=True)  # [batch, 1]
        tokens, _ = _invert_cdf(_truncate(scores - lse, s), s, positions)
    else:
        tokens, lse = _invert_cdf(scores, s, positions)  # [batch], [batch, 1]
    if s.greedy_rows is not None:
        tokens[s.greedy_rows] = scores[s.greedy_rows].argmax(dim=-1)
    return tokens, StepScores(scores, lse)


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """Top-k (log-prob, token id) pairs per row.  logprobs: [rows, vocab]."""
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]


def ids_logprobs(logprobs: torch.Tensor, token_ids: list[int]) -> list[list[tuple[float, int]]]:
    """(log-prob, token id) of the given ids per row.  logprobs: [rows, vocab]."""
    index = torch.tensor(token_ids, device=logprobs.device)
    values = logprobs.index_select(-1, index).tolist()  # [rows, len(ids)]
    return [list(zip(v, token_ids, strict=True)) for v in values]


PromptScores = tuple[
    list[float | None],
    list[list[tuple[float, int]] | None] | None,
    list[list[tuple[float, int]] | None] | None,
]
"""(log-probs, top-k pairs, `token_ids_logprob` pairs) per prompt position; the first is None."""


def prompt_scores(req: Any, logits: torch.Tensor, inv_temp: float) -> PromptScores:
    """A `GenerateRequest`'s prompt scores from the logits over its prompt.  logits: [prompt, vocab]."""
    ids = req.input_ids
    lp = logprobs_of(logits[:-1], torch.tensor(inv_temp))  # [prompt-1, vocab]; predicts ids[1:]
    target = torch.tensor(ids[1:], device=lp.device)
    chosen: list[float | None] = [None, *lp.gather(-1, target[:, None])[:, 0].tolist()]
    top = [None, *top_logprobs(lp, req.top_logprobs_num)] if req.top_logprobs_num > 0 else None
    by_id = [None, *ids_logprobs(lp, req.token_ids_logprob)] if req.token_ids_logprob else None
    return chosen, top, by_id
