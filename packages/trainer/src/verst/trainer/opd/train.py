"""On-policy distillation on the train side: teacher tensors, the student's top-k, the OPD terms.

Per train step (`OpdTrainer`):

1. `collate_opd` (called by `build_train_batch`) turns the samples' `teacher_*` metadata
   (engine teachers, see `verst.trainer.opd.scoring`) into `[B, R]` / `[B, R, k]` tensors.
2. `prepare` runs one no-grad pass of the student over the batch (the policy before the update):
   its log-probs of the sampled tokens and, for top-k OPD, its top-k ids per response position,
   from the hidden states through `verst.kernels.linear_topk_logprobs` (chunked: no
   `[tokens, vocab]` tensor). Teachers run in the trainer (`type = "trainer"`, or any whose
   `capabilities().scored_in_rollout` is false) run the same way and also score the student's
   top-k ids (`token_ids=`), which student-side token sets need.
3. Sampled-token OPD (`log_prob_top_k = 0`): `fold_advantages` subtracts
   `coef * (student_logp - teacher_logp)` from each token's advantage.
4. Top-k OPD (`log_prob_top_k > 0`): `forward_with_kl` is the micro-step forward; the student's
   differentiable log-probs of the candidates (its top-k ids from step 2, then the teacher's
   top-k ids: `[N, 2k]`) come from the same chunked kernel call, `topk_opd_kl` gives the
   per-token KL, and `OpdTopKTerm` (a loss term) aggregates it with the policy loss's
   `LossNorm` and adds it with weight `coef`.

`OpdTrainer` is a step extension of the train side (`begin_step` = 2 + 3, `forward` and `terms`
= 4, `step_metrics`); the train side knows nothing else of OPD.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from verst.rollout.sample import Sample
from verst.trainer.algorithms.aggregation import Aggregation
from verst.trainer.algorithms.terms import LossTerm, MicroBatch, TermOutput
from verst.trainer.opd.config import OpdConfig
from verst.trainer.opd.scoring import (
    TEACHER_LOGPROBS_KEY,
    TEACHER_NAME_KEY,
    TEACHER_TOPK_IDS_KEY,
    TEACHER_TOPK_LOGPROBS_KEY,
)
from verst.trainer.opd.teachers import TeacherLoader
from verst.trainer.opd.token_sets import TopKSides, sampled_token_opd_advantage, topk_opd_kl
from verst.trainer.train.logit_head import LogitHead
from verst.trainer.train.logprobs import PackedInputs, PolicyLogprobs, pack_sequences, unflatten
from verst.trainer.train.optim import eval_mode


@dataclass
class OpdBatch:
    """The teacher side of a train batch, from the samples' metadata."""

    teachers: list[str | None]
    """Teacher name per sample (None = not distilled)."""
    teacher_logprobs: Tensor  # [B, R]
    """Engine teachers' log-probs of the sampled tokens (0 where unknown)."""
    scored: list[bool]
    """Per sample: True when `teacher_logprobs` (and top-k) came from an engine teacher."""
    teacher_topk_ids: Tensor | None = None  # [B, R, k]
    """Engine teachers' top-k ids per response position (top-k OPD)."""
    teacher_topk_logprobs: Tensor | None = None  # [B, R, k]
    """Their log-probs."""


def collate_opd(samples: Sequence[Sample], width: int) -> OpdBatch | None:
    """`OpdBatch` from the samples' `teacher_*` metadata, or None when no sample was distilled."""
    if not any(TEACHER_NAME_KEY in (s.metadata or {}) for s in samples):
        return None
    b = len(samples)
    teacher_lp = torch.zeros((b, width))
    k = next((len(row) for s in samples for row in (s.metadata.get(TEACHER_TOPK_IDS_KEY) or ()) if row), 0)
    ids = torch.zeros((b, width, k), dtype=torch.long) if k else None
    vals = torch.zeros((b, width, k)) if k else None
    scored = []
    for i, s in enumerate(samples):
        lps = s.metadata.get(TEACHER_LOGPROBS_KEY)
        scored.append(lps is not None)
        r = s.response_length
        if lps:
            teacher_lp[i, :r] = torch.tensor(lps[:r], dtype=torch.float32)
        top_ids = s.metadata.get(TEACHER_TOPK_IDS_KEY)
        if k and top_ids:
            ids[i, :r] = torch.tensor(top_ids[:r], dtype=torch.long)  # type: ignore[index]
            vals[i, :r] = torch.tensor(s.metadata[TEACHER_TOPK_LOGPROBS_KEY][:r], dtype=torch.float32)  # type: ignore[index]
    return OpdBatch(
        teachers=[s.metadata.get(TEACHER_NAME_KEY) for s in samples],
        teacher_logprobs=teacher_lp,
        scored=scored,
        teacher_topk_ids=ids,
        teacher_topk_logprobs=vals,
    )


@dataclass
class OpdStepInputs:
    """Everything the OPD terms of one train step need, `[B, R]` / `[B, R, k]`, on CPU."""

    student_logprobs: Tensor  # [B, R]
    """The student's (pre-update, no-grad) log-probs of the sampled tokens."""
    teacher_logprobs: Tensor  # [B, R]
    """The teacher's log-probs of the sampled tokens."""
    distilled: Tensor  # [B, 1]
    """1.0 for samples with a teacher, 0.0 otherwise."""
    student_topk_ids: Tensor | None = None  # [B, R, k]
    """The student's top-k ids (top-k OPD)."""
    teacher_topk_ids: Tensor | None = None  # [B, R, k]
    """The teacher's top-k ids (top-k OPD)."""
    teacher_topk_logprobs: Tensor | None = None  # [B, R, k]
    """The teacher's top-k log-probs."""
    teacher_on_student: Tensor | None = None  # [B, R, k]
    """The teacher's log-probs of the student's top-k ids (trainer teachers only, else None)."""


def _unflatten_k(flat: Tensor, response_lengths: Sequence[int], width: int) -> Tensor:
    """`[sum(R), k]` → `[num_seqs, width, k]` (zeros past each response)."""
    out = flat.new_zeros((len(response_lengths), width, flat.shape[-1]))
    offset = 0
    for row, r in enumerate(response_lengths):
        out[row, :r] = flat[offset : offset + r]
        offset += r
    return out


def _flatten_k(x: Tensor, response_lengths: Sequence[int]) -> Tensor:
    """`[num_seqs, width, k]` → `[sum(R), k]` (inverse of `_unflatten_k`)."""
    return torch.cat([x[i, :r] for i, r in enumerate(response_lengths)], dim=0)


OPD_TOPK_KL = "opd_topk_kl"
"""`MicroBatch.extras` key of the top-k OPD per-token KL `[b, R]` (and its metric)."""


@dataclass(frozen=True, slots=True)
class OpdTopKTerm:
    """``coef · agg(KL_topk)``: top-k OPD's loss term (nothing when the forward gave no KL)."""

    coef: float
    aggregate: Aggregation

    def __call__(self, mb: MicroBatch) -> TermOutput:
        kl = mb.extras.get(OPD_TOPK_KL)
        if kl is None:
            return TermOutput(None)
        mean = (kl.detach() * mb.mask).sum().double() / mb.mask.sum().double().clamp(min=1.0)
        return TermOutput(self.coef * self.aggregate(kl, mb.mask, mb.norm), {OPD_TOPK_KL: mean})


class OpdTrainer:
    """The train-side half of OPD for one `TrainSide` (see module doc); a step extension."""

    def __init__(
        self,
        opd: OpdConfig,
        *,
        temperature: float,
        chunk_size: int,
        packing: bool,
        micro_batch_size: int,
        teacher_loader: TeacherLoader | None = None,
    ) -> None:
        """`teacher_loader(model_path, dtype)` builds a frozen `PolicyLogprobs`; each teacher run in
        the trainer is built with it (`TeacherSection.build_model`)."""
        self.opd = opd
        self.k = opd.log_prob_top_k
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.packing = packing
        self.micro_batch_size = micro_batch_size
        self.teachers: dict[str, PolicyLogprobs] = {}
        """Trainer teachers by name (frozen, eval mode)."""
        self.inputs: OpdStepInputs | None = None
        """The current step's inputs (set by `begin_step`)."""
        for name, t in opd.teachers.items():
            if not t.capabilities().scored_in_rollout:
                if teacher_loader is None:
                    raise ValueError("teachers run in the trainer need a teacher_loader")
                self.teachers[name] = t.build_model(teacher_loader)

    # ------------------------------------------------------------ the step extension

    def begin_step(self, module: torch.nn.Module, batch: Any, advantages: Tensor) -> Tensor:
        """`prepare` the step's OPD inputs, then fold sampled-token OPD into the advantages."""
        self.inputs = self.prepare(module, batch)
        return self.fold_advantages(advantages, batch.loss_mask, self.inputs)

    def forward(
        self, module: torch.nn.Module, batch: Any, rows: list[int]
    ) -> tuple[Tensor, Tensor | None, dict[str, Tensor]] | None:
        """Top-k OPD's micro-step forward (None for sampled-token OPD: the default forward)."""
        if not self.k or self.inputs is None:
            return None
        lp, ent, kl = self.forward_with_kl(module, batch, rows, self.inputs)
        return lp, ent, {OPD_TOPK_KL: kl}

    def terms(self, aggregate: Aggregation) -> list[LossTerm]:
        """Top-k OPD's KL term (sampled-token OPD lives in the advantages)."""
        return [OpdTopKTerm(self.opd.coef, aggregate)] if self.k else []

    def step_metrics(self, mask: Tensor) -> dict[str, float]:
        """`opd/*` metrics of the step just run."""
        return self.metrics(mask, self.inputs) if self.inputs is not None else {}

    # ------------------------------------------------------------ forwards

    def _pack(self, batch: Any, rows: Sequence[int]) -> PackedInputs:
        return pack_sequences(
            [batch.tokens[i] for i in rows], [batch.response_lengths[i] for i in rows], packing=self.packing
        )

    def _topk_fn(self, k: int, token_ids: Tensor | None) -> Callable[[Tensor, LogitHead], Any]:
        from verst.kernels import linear_topk_logprobs

        def fn(hidden: Tensor, head: LogitHead) -> Any:  # hidden: [N, H]
            ids = token_ids.to(hidden.device) if token_ids is not None else None
            return linear_topk_logprobs(
                hidden, k=k, token_ids=ids, chunk_size=self.chunk_size, **head.kernel_args(self.temperature)
            )

        return fn

    @torch.no_grad()
    def prepare(self, student: torch.nn.Module, batch: Any) -> OpdStepInputs:
        """Student log-probs / top-k ids and trainer teachers' log-probs for the whole batch."""
        ob: OpdBatch | None = batch.opd
        if ob is None:
            raise ValueError(
                "opd is enabled but the batch carries no teacher information; the rollout side must "
                "score the samples (RolloutSide with the same [opd] config)"
            )
        B = batch.loss_mask.shape[0]
        out = self._empty_inputs(ob, batch.loss_mask.shape)
        with eval_mode(student):
            for start in range(0, B, self.micro_batch_size):
                mb = list(range(start, min(start + self.micro_batch_size, B)))
                self._score_student(student, batch, mb, out)
                for name, teacher in self.teachers.items():
                    rows = [i for i in mb if ob.teachers[i] == name]
                    if rows:
                        self._score_teacher(teacher, batch, rows, out)
        missing = [
            i
            for i, t in enumerate(ob.teachers)
            if t is not None and t not in self.teachers and not ob.scored[i]
        ]
        if missing:
            raise ValueError(
                f"samples {missing[:5]} name engine teachers but carry no teacher log-probs; "
                "they were not scored (was the rollout built with the same [opd] config?)"
            )
        return out

    def _empty_inputs(self, ob: OpdBatch, shape: tuple[int, int]) -> OpdStepInputs:
        """The step's inputs before the passes: the rollout side's teacher values where it
        scored, zeros where the trainer's passes fill in."""
        B, R = shape
        k = self.k
        t_ids = ob.teacher_topk_ids.clone() if (k and ob.teacher_topk_ids is not None) else None
        t_vals = ob.teacher_topk_logprobs.clone() if (k and ob.teacher_topk_logprobs is not None) else None
        if k and t_ids is None:
            t_ids = torch.zeros((B, R, k), dtype=torch.long)
            t_vals = torch.zeros((B, R, k))
        return OpdStepInputs(
            student_logprobs=torch.zeros((B, R)),
            teacher_logprobs=ob.teacher_logprobs.clone(),
            distilled=torch.tensor([[1.0 if t is not None else 0.0] for t in ob.teachers]),
            student_topk_ids=torch.zeros((B, R, k), dtype=torch.long) if k else None,
            teacher_topk_ids=t_ids,
            teacher_topk_logprobs=t_vals,
            teacher_on_student=torch.zeros((B, R, k)) if (k and self.teachers) else None,
        )

    def _score_student(
        self, student: torch.nn.Module, batch: Any, rows: list[int], out: OpdStepInputs
    ) -> None:
        """The student's log-probs (and top-k ids) of `rows`, into `out`."""
        k, R = self.k, out.student_logprobs.shape[1]
        inputs = self._pack(batch, rows)
        res = student(inputs, temperature=self.temperature, hidden_fn=self._topk_fn(k, None) if k else None)
        out.student_logprobs[rows] = unflatten(res[0].float().cpu(), inputs.response_lengths, R)
        if k:
            out.student_topk_ids[rows] = _unflatten_k(res[2].indices.cpu(), inputs.response_lengths, R)  # type: ignore[index]

    def _score_teacher(self, teacher: Any, batch: Any, rows: list[int], out: OpdStepInputs) -> None:
        """A trainer teacher's log-probs of `rows` (with top-k: its top-k and its log-probs of the
        student's top-k ids), into `out`."""
        k, R = self.k, out.student_logprobs.shape[1]
        t_in = self._pack(batch, rows)
        want = _flatten_k(out.student_topk_ids[rows], t_in.response_lengths) if k else None  # type: ignore[index]
        t_out = teacher(t_in, temperature=self.temperature, hidden_fn=self._topk_fn(k, want) if k else None)
        lengths = t_in.response_lengths
        out.teacher_logprobs[rows] = unflatten(t_out[0].float().cpu(), lengths, R)
        if k:
            top = t_out[2]
            out.teacher_topk_ids[rows] = _unflatten_k(top.indices.cpu(), lengths, R)  # type: ignore[index]
            out.teacher_topk_logprobs[rows] = _unflatten_k(top.values.float().cpu(), lengths, R)  # type: ignore[index]
            out.teacher_on_student[rows] = _unflatten_k(top.token_logprobs.float().cpu(), lengths, R)  # type: ignore[index]

    # ------------------------------------------------------------ the terms

    def fold_advantages(self, advantages: Tensor, mask: Tensor, inputs: OpdStepInputs) -> Tensor:
        """Task advantages (or zeros) plus sampled-token OPD (`log_prob_top_k = 0`). All `[B, R]`."""
        adv = advantages if self.opd.with_task_reward else torch.zeros_like(advantages)
        if self.k:
            return adv
        m = mask * inputs.distilled
        opd_adv = sampled_token_opd_advantage(
            torch.zeros_like(adv), inputs.student_logprobs, inputs.teacher_logprobs, m, self.opd.coef
        )
        return adv + opd_adv

    def metrics(self, mask: Tensor, inputs: OpdStepInputs) -> dict[str, float]:
        """`opd/*` metrics of the step: the sampled-token reverse KL estimate (masked mean)."""
        m = mask * inputs.distilled
        ntok = float(m.sum())
        rkl = ((inputs.student_logprobs - inputs.teacher_logprobs) * m).sum()
        return {"opd/sampled_reverse_kl": float(rkl) / max(ntok, 1.0), "opd/distilled_tokens": ntok}

    def forward_with_kl(
        self, module: torch.nn.Module, batch: Any, rows: list[int], inputs: OpdStepInputs
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """Micro-step forward for top-k OPD: log-probs, entropy and the per-token KL, all `[b, R]`."""
        R = batch.max_response_len
        packed = self._pack(batch, rows)
        lengths = packed.response_lengths
        s_ids = _flatten_k(inputs.student_topk_ids[rows], lengths)  # type: ignore[index]  # [N, k]
        t_ids = _flatten_k(inputs.teacher_topk_ids[rows], lengths)  # type: ignore[index]  # [N, k]
        cand = torch.cat([s_ids, t_ids], dim=-1)  # [N, 2k]
        lp, ent, top = module(
            packed, temperature=self.temperature, return_entropy=True, hidden_fn=self._topk_fn(1, cand)
        )
        device = lp.device
        both = top.token_logprobs  # [N, 2k], differentiable
        k = self.k
        t_on_s = inputs.teacher_on_student
        sides = TopKSides(
            student_ids=s_ids.to(device),
            student_logp=both[:, :k],
            teacher_ids=t_ids.to(device),
            teacher_logp=_flatten_k(inputs.teacher_topk_logprobs[rows], lengths).to(device),  # type: ignore[index]
            student_logp_on_teacher_ids=both[:, k:],
            teacher_logp_on_student_ids=_flatten_k(t_on_s[rows], lengths).to(device)
            if t_on_s is not None
            else None,
        )
        kl = topk_opd_kl(sides, self.opd.token_set, self.opd.weighting, tail=self.opd.topk_tail)  # [N]
        kl = unflatten(kl, lengths, R) * inputs.distilled[rows].to(device)  # [b, R]
        return unflatten(lp, lengths, R), unflatten(ent, lengths, R) if ent is not None else None, kl
