"""Top-k on-policy distillation: the KL over a per-position token set.

At every response position the student and the teacher each propose their k most likely
tokens. A *token-set strategy* picks which of those tokens the KL is summed over, and a
*weighting* says how each token counts:

    loss(pos) = sum_{v in S(pos)} w(v) * (log p_s(v) - log p_t(v))

with `w = p_s(v)` (student-weighted: the top-k estimate of the reverse KL KL(s || t)),
`w = p_t(v)` (teacher-weighted), or `w = 1` (uniform). An empty set contributes 0.

Gradient. The value above is what is reported and aggregated; its gradient is defined as

    grad loss(pos) = sum_{v in S(pos)} w(v) * (log p_s(v) - log p_t(v)) * grad log p_s(v)

(weights and log-ratios held constant): every candidate's student log-prob moves towards the
teacher's, in proportion to its weight. For student weights and the full vocabulary this is
exactly grad KL(s || t) (the `sum_v grad p_s(v)` term of the exact gradient vanishes there). The
plain gradient of the value would not do: over a *subset* that term is `grad P_s(S)`, so
minimising it pushes the student's mass out of its own top-k (towards a uniform distribution),
and with teacher or uniform weights it would even push the student away from the teacher.

Only `[positions, k]` tensors are involved: the candidate tokens are the student's top-k ids
followed by the teacher's top-k ids (`[positions, 2k]`), so neither side needs a full-vocabulary
tensor. For each candidate we need both log-probs: the student's (its top-k values, and its
log-probs on the teacher's ids — differentiable, from `verst.kernels`) and the teacher's (its
top-k values, and its log-probs on the student's ids).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

TOKEN_SET_STRATEGIES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "only_student": lambda in_s, in_t: in_s,
    "only_teacher": lambda in_s, in_t: in_t,
    "intersection": lambda in_s, in_t: in_s & in_t,
    "union": lambda in_s, in_t: in_s | in_t,
    "xor": lambda in_s, in_t: in_s ^ in_t,
}
"""Strategy name → which candidates are in the set, from membership in each side's top-k."""

WEIGHTINGS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "student": lambda s_logp, t_logp: s_logp.detach().exp(),
    "teacher": lambda s_logp, t_logp: t_logp.exp(),
    "uniform": lambda s_logp, t_logp: torch.ones_like(s_logp),
}
"""Weighting name → per-candidate weight from (student log-prob, teacher log-prob)."""

STRATEGIES_NEEDING_TEACHER_ON_STUDENT_IDS = frozenset({"only_student", "union", "xor"})
"""Strategies whose set can hold student-only tokens: the teacher must score the student's ids."""


@dataclass(frozen=True, slots=True)
class TopKSides:
    """Both sides' top-k at every position, and each side's log-probs on the other's ids."""

    student_ids: Tensor
    """[P, k] the student's top-k token ids."""
    student_logp: Tensor
    """[P, k] the student's log-probs of `student_ids` (grad flows)."""
    teacher_ids: Tensor
    """[P, k] the teacher's top-k token ids."""
    teacher_logp: Tensor
    """[P, k] the teacher's log-probs of `teacher_ids`."""
    student_logp_on_teacher_ids: Tensor
    """[P, k] the student's log-probs of `teacher_ids` (grad flows)."""
    teacher_logp_on_student_ids: Tensor | None
    """[P, k] the teacher's log-probs of `student_ids`; None if the teacher only gave its top-k."""


def topk_opd_kl(sides: TopKSides, strategy: str, weighting: str, *, tail: bool = False) -> Tensor:
    """Per-position weighted KL over the selected token set → `[P]` (float32, differentiable).

    `tail=True` adds one more term per position for the mass *outside* the set, as if it were
    one token: `log p(tail) = log(1 - sum_{v in S} p(v))` on each side, weighted like the others.
    Without it nothing in the loss sees the student's mass outside the set, which can grow.
    """
    if strategy not in TOKEN_SET_STRATEGIES:
        raise ValueError(
            f"unknown token-set strategy {strategy!r}; choose from {sorted(TOKEN_SET_STRATEGIES)}"
        )
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {weighting!r}; choose from {sorted(WEIGHTINGS)}")
    teacher_on_student = sides.teacher_logp_on_student_ids
    if teacher_on_student is None:
        if strategy in STRATEGIES_NEEDING_TEACHER_ON_STUDENT_IDS:
            raise ValueError(
                f"token-set strategy {strategy!r} needs the teacher's log-probs of the student's top-k ids; "
                "score them with the teacher (token_ids_logprob) or use only_teacher / intersection"
            )
        teacher_on_student = torch.zeros_like(sides.student_logp, dtype=torch.float32)

    # Membership of each side's ids in the other side's top-k: [P, k, k] comparisons, k is small.
    same = sides.student_ids.unsqueeze(-1) == sides.teacher_ids.unsqueeze(-2)  # [P, k_s, k_t]
    student_in_teacher = same.any(-1)  # [P, k]
    teacher_in_student = same.any(-2)  # [P, k]

    ones = torch.ones_like(student_in_teacher)
    in_s = torch.cat([ones, teacher_in_student], dim=-1)  # [P, 2k]
    in_t = torch.cat([student_in_teacher, ones], dim=-1)  # [P, 2k]
    # A token both sides proposed is counted once, through its teacher-side slot, where both
    # log-probs are known without the teacher scoring the student's ids.
    counted = torch.cat([~student_in_teacher, ones], dim=-1)  # [P, 2k]
    selected = TOKEN_SET_STRATEGIES[strategy](in_s, in_t) & counted

    s_logp = torch.cat([sides.student_logp, sides.student_logp_on_teacher_ids], dim=-1).float()
    t_logp = torch.cat([teacher_on_student, sides.teacher_logp], dim=-1).float()
    weight = WEIGHTINGS[weighting](s_logp, t_logp).detach()
    ratio = (s_logp - t_logp).detach()
    # value w * ratio; gradient w * ratio * grad(log p_s) (see the module doc)
    terms = weight * ratio * (1.0 + s_logp - s_logp.detach())  # [P, 2k]
    out = torch.where(selected, terms, torch.zeros_like(terms)).sum(-1)  # [P]
    if tail:
        zero = torch.zeros_like(s_logp)
        mass_s = torch.where(selected, s_logp.exp(), zero).sum(-1)  # [P], grad flows
        mass_t = torch.where(selected, t_logp.exp(), zero).sum(-1).detach()  # [P]
        tail_s = torch.log1p(-mass_s.clamp(max=1.0 - 1e-6))  # [P] log p_s(tail)
        tail_t = torch.log1p(-mass_t.clamp(max=1.0 - 1e-6))  # [P] log p_t(tail)
        w_tail = WEIGHTINGS[weighting](tail_s, tail_t).detach()
        out = out + w_tail * (tail_s - tail_t).detach() * (1.0 + tail_s - tail_s.detach())
    return out


def sampled_token_opd_advantage(
    advantages: Tensor, student_logp: Tensor, teacher_logp: Tensor, mask: Tensor, coef: float
) -> Tensor:
    """Sampled-token OPD folded into the advantage: `adv - coef * (student_logp - teacher_logp)`.

    All `[B, T]`; the student log-probs are the (detached) old-policy ones. Masked tokens stay 0.
    """
    reverse_kl = (student_logp - teacher_logp).detach()
    return (advantages - coef * reverse_kl) * mask
