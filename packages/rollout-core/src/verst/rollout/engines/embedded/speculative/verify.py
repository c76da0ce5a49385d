"""The speculative-sampling rule: which proposed tokens a row keeps, and the token after them.

For a row with proposals `d_0 … d_{m-1}` drawn from `q_0 … q_{m-1}` and the target's verification
logits at `m + 1` positions, proposal `t` is accepted with probability `min(1, p_t(d_t) / q_t(d_t))`
while every earlier one was; at the first rejection the row draws from the residual
`max(0, p_t − q_t)` normalised, and when all `m` are accepted it draws a bonus token from `p_m`.
`p_t` is exactly the distribution plain decoding samples from at that position: `softmax(logits / T)`
restricted to the row's top-k / top-p set (`sampling._truncate`, the same function). That keeps the
emitted tokens distributed as the target's (Leviathan et al. 2023, Chen et al. 2023). A proposer
without a distribution (n-gram lookup) proposes a point mass: `q_t = δ(d_t)`, so `d_t` is accepted
with probability `p_t(d_t)` and a rejection draws from `p_t` with `d_t` removed and renormalised.
Greedy rows (T = 0) accept a proposal iff it is the argmax, and emit the argmax: token for token
what plain greedy decoding emits (a batch of greedy rows only takes one argmax over the verified
positions and skips the filtered probabilities and draws).

Draws: a seeded row's accept uniform at a position is a hash of (seed, position) on its own
stream (`ACCEPT_SALT`), its residual draw and its bonus draw use the plain sampler's stream at
that position (`sampling.seeded_uniforms`: the bonus is drawn by `sampling.sample` itself), so a
seeded speculative request is reproducible, its tokens depending only on its seed and its own
history. They may differ from a seeded plain request's (the accept draws are extra randomness):
both are exact samples of the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from verst.rollout.engines.embedded.sampling import BatchSampling, _mix, _truncate, sample, seeded_uniforms

ACCEPT_SALT = 0x5BD1E995
"""Xored into a seed's key for its accept uniforms (a stream apart from the sampler's)."""
DRAFT_SALT = 0x27D4EB2F
"""Xored into a seed's key for a draft model's proposal draws."""


def draws(s: BatchSampling, positions: torch.Tensor, salt: int | None = None) -> torch.Tensor:
    """Uniforms in (0, 1], one per entry of `positions` ([rows, m] long): the shared RNG's for
    unseeded rows, seeded rows' from (seed key ^ salt, position) (`salt=None`: the plain sampler's
    own stream)."""
    u = 1.0 - torch.rand(positions.shape, device=positions.device)
    if s.seeded_rows is not None:
        assert s.seed_keys is not None
        keys = s.seed_keys if salt is None else _mix(s.seed_keys ^ salt)
        at = positions[s.seeded_rows]  # [seeded, m]
        u[s.seeded_rows] = seeded_uniforms(keys[:, None].expand_as(at), at)
    return u


def filtered_probs(scores: torch.Tensor, s: BatchSampling) -> torch.Tensor:
    """The distribution plain decoding samples from: `softmax(scores)` over each row's top-k /
    top-p set.  scores ([rows, m, vocab], logits / T) → probabilities [rows, m, vocab]."""
    n, m, vocab = scores.shape
    flat = torch.log_softmax(scores.reshape(n * m, vocab), -1)
    if s.truncate:
        per = SimpleNamespace(top_k=s.top_k.repeat_interleave(m, 0), top_p=s.top_p.repeat_interleave(m, 0))
        flat = _truncate(flat, per)  # type: ignore[arg-type]
    return torch.softmax(flat, -1).view(n, m, vocab)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A token per row from unnormalised `weights` ([rows, vocab] ≥ 0) at uniforms `u` ([rows])."""
    cdf = weights.double().cumsum(-1)
    x = (u.double() * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, x)[:, 0].clamp_(max=weights.shape[-1] - 1)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One verification's outcome per row (slot)."""

    accepted: torch.Tensor  # [rows] long
    """Proposals kept."""
    tokens: torch.Tensor  # [rows, k + 1] long
    """Row i emits `tokens[i, : accepted[i] + 1]`: its kept proposals, then the drawn token."""
    scores: torch.Tensor  # [rows, k + 1, vocab] float32
    """`logits / T` at each verified position (untruncated)."""
    lse: torch.Tensor  # [rows, k + 1, 1] float32
    """Their log-sum-exp: the reported log-probs are `scores − lse`."""


def _accepts(
    scores: torch.Tensor,
    p: torch.Tensor,
    proposals: torch.Tensor,
    q: torch.Tensor | None,
    s: BatchSampling,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Whether each proposal passes its own test ([rows, k] bool; earlier ones not considered)."""
    k = proposals.shape[1]
    pd = p.gather(-1, proposals[:, :, None])[:, :, 0]  # [rows, k]
    qd = torch.ones_like(pd) if q is None else q.gather(-1, proposals[:, :, None])[:, :, 0]
    at = positions[:, None] + torch.arange(k, device=positions.device)[None]  # positions of the proposals
    ok = draws(s, at, ACCEPT_SALT) * qd <= pd  # u ≤ p / q, u in (0, 1]
    greedy_ok = proposals == scores.argmax(-1)
    return torch.where(s.greedy[:, None], greedy_ok, ok & (pd > 0))


def verify(
    logits: torch.Tensor,
    proposals: torch.Tensor,
    counts: torch.Tensor,
    q: torch.Tensor | None,
    s: BatchSampling,
    positions: torch.Tensor,
) -> Verdict:
    """Apply the rule to every row.

    logits: [rows, k + 1, vocab], the target's at the positions predicting `d_0 … d_k`'s slots;
    proposals: [rows, k] long (entries past a row's count are ignored); counts: [rows] long, each
    row's proposals; q: [rows, k, vocab] the draft's distributions (None: point masses);
    positions: [rows] long, the sequence position of each row's first drawn token."""
    n, k1, _ = logits.shape
    k = k1 - 1
    # [rows, k + 1, vocab]; unit temperatures skip the scaling pass (as `sampling.sample`)
    scores = logits.float() if s.unit_temp else logits.float() * s.inv_temp[:, :, None]
    lse = torch.logsumexp(scores, -1, keepdim=True)
    if s.all_greedy:  # every row: accept while the proposal is the argmax, then emit the argmax
        top = scores.argmax(-1)  # [rows, k + 1]: what plain greedy decoding emits at each position
        ok = (proposals == top[:, :k]) & (torch.arange(k, device=logits.device)[None] < counts[:, None])
        return Verdict(ok.long().cumprod(1).sum(1), top, scores, lse)
    idx = torch.arange(n, device=logits.device)
    if k:
        p = filtered_probs(scores[:, :k], s)
        ok = _accepts(scores[:, :k], p, proposals, q, s, positions)
        ok &= torch.arange(k, device=logits.device)[None] < counts[:, None]
        accepted = ok.long().cumprod(1).sum(1)  # [rows]: leading accepts
    else:
        accepted = torch.zeros(n, dtype=torch.long, device=logits.device)
    final, _ = sample(logits[idx, accepted], s, positions + accepted)  # the bonus (plain sampler)
    rejected = (accepted < counts).nonzero()[:, 0]
    if rejected.numel():
        final[rejected] = _residual(scores, p, proposals, q, s, positions, accepted, rejected)
    tokens = torch.cat([proposals, proposals.new_zeros((n, 1))], 1) if k else final.new_zeros((n, 1))
    tokens[idx, accepted] = final
    return Verdict(accepted, tokens, scores, lse)


def _residual(
    scores: torch.Tensor,
    p: torch.Tensor,
    proposals: torch.Tensor,
    q: torch.Tensor | None,
    s: BatchSampling,
    positions: torch.Tensor,
    accepted: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """The token drawn from `max(0, p − q)` (normalised) at each rejected row's first rejection."""
    t = accepted[rows]
    pr = p[rows, t]  # [r, vocab]
    qr = q[rows, t] if q is not None else torch.zeros_like(pr).scatter_(-1, proposals[rows, t][:, None], 1.0)
    res = (pr - qr).clamp_(min=0)
    empty = res.sum(-1) <= 0  # p == q: a rejection had probability 0; draw from p
    res[empty] = pr[empty]
    u = draws(s, (positions + accepted)[:, None])[rows, 0]  # the plain sampler's stream there
    tok = _inverse_cdf(res, u)
    greedy = s.greedy[rows]
    return torch.where(greedy, scores[rows, t].argmax(-1), tok)


def as_distribution(tokens: Any, vocab: int) -> torch.Tensor:
    """Point masses at `tokens` ([rows, k] long) as distributions [rows, k, vocab] (tests)."""
    return torch.nn.functional.one_hot(torch.as_tensor(tokens), vocab).float()
