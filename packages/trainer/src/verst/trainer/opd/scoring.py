"""Teacher scoring on the rollout side: teacher log-probs of every kept sample's response.

After the rollout strategy returns (default, fully-async or legacy — scoring does not depend on
how the samples were generated), each sample is scored by its teacher: one request with
`max_new_tokens = 0`, `logprob_start_len = 0` and `return_logprob` over the sample's tokens
(prompt + response). Prompt log-probs at position `j` are the teacher's log-prob of token `j`
given the tokens before it, so the last `response_length` of them are the teacher's log-probs of
the response tokens. Top-k OPD also asks `top_logprobs_num = k`.

Results go into `sample.metadata` (plain lists, so they survive `to_dict` / Ray / checkpoints):

- `opd_teacher`: the teacher's name (`opd.teacher_key` in the metadata, else the default);
- `teacher_logprobs`: `[R]` teacher log-prob of each response token (engine teachers);
- `teacher_topk_ids`, `teacher_topk_logprobs`: `[R][k]` the teacher's top-k per response
  position, descending (engine teachers, top-k OPD).

Teachers run in the trainer (`capabilities().scored_in_rollout` false, e.g. `type = "trainer"`)
are only named here; the train side computes their log-probs (see `verst.trainer.opd.train`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from verst.rollout.engine import GenerateRequest, InferenceEngine, SamplingParams
from verst.rollout.sample import Sample, Status
from verst.trainer.opd.config import OpdConfig

TEACHER_NAME_KEY = "opd_teacher"
"""Metadata key: the name of the sample's teacher."""
TEACHER_LOGPROBS_KEY = "teacher_logprobs"
"""Metadata key: `[R]` teacher log-probs of the response tokens."""
TEACHER_TOPK_IDS_KEY = "teacher_topk_ids"
"""Metadata key: `[R][k]` the teacher's top-k token ids per response position."""
TEACHER_TOPK_LOGPROBS_KEY = "teacher_topk_logprobs"
"""Metadata key: `[R][k]` the teacher's top-k log-probs per response position."""


def select_teacher(sample: Sample, opd: OpdConfig) -> str:
    """The teacher named by `sample.metadata[opd.teacher_key]`, else the default teacher."""
    name = (sample.metadata or {}).get(opd.teacher_key)
    if name is None:
        name = opd.default_teacher_name()
    if name not in opd.teachers:
        raise ValueError(
            f"sample {sample.group_index}/{sample.sample_index} names teacher {name!r} in "
            f"metadata[{opd.teacher_key!r}], but the configured teachers are {sorted(opd.teachers)}; "
            "add it under [opd.teachers] or fix the dataset's metadata"
        )
    return str(name)


async def score_sample(
    engine: InferenceEngine, sample: Sample, *, top_k: int, temperature: float, rid: str = ""
) -> None:
    """Fill the sample's `teacher_*` metadata from one scoring request to `engine`."""
    r = sample.response_length
    meta = sample.metadata
    if r == 0:
        meta[TEACHER_LOGPROBS_KEY] = []
        if top_k:
            meta[TEACHER_TOPK_IDS_KEY], meta[TEACHER_TOPK_LOGPROBS_KEY] = [], []
        return
    request = GenerateRequest(
        input_ids=list(sample.tokens),
        sampling=SamplingParams(max_new_tokens=0, temperature=temperature if temperature > 0 else 1.0),
        rid=rid,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=top_k,
    )
    out = await engine.generate(request)
    n = len(sample.tokens)
    lps = out.input_logprobs
    if lps is None or len(lps) != n:
        raise RuntimeError(
            f"the teacher engine returned {None if lps is None else len(lps)} prompt log-probs for "
            f"{n} tokens; it must support scoring (max_new_tokens=0, logprob_start_len=0)"
        )
    meta[TEACHER_LOGPROBS_KEY] = [float(x) for x in lps[n - r :]]  # type: ignore[arg-type]
    if top_k:
        tops = out.input_top_logprobs
        if tops is None or len(tops) != n:
            raise RuntimeError("the teacher engine returned no prompt top-k log-probs (top_logprobs_num)")
        rows = tops[n - r :]
        meta[TEACHER_TOPK_IDS_KEY] = [[int(tid) for _, tid in row[:top_k]] for row in rows]  # type: ignore[union-attr]
        meta[TEACHER_TOPK_LOGPROBS_KEY] = [[float(lp) for lp, _ in row[:top_k]] for row in rows]  # type: ignore[union-attr]


class TeacherScorer:
    """Names every sample's teacher and scores it with that teacher's engine (engine teachers)."""

    def __init__(self, opd: OpdConfig, engines: Mapping[str, InferenceEngine], *, temperature: float) -> None:
        self.opd = opd
        self.engines = dict(engines)
        """Engine teachers by name (trainer teachers have none)."""
        self.temperature = temperature

    async def score(self, groups: Sequence[Sequence[Sample]], *, rid_prefix: str = "opd") -> dict[str, float]:
        """Score every sample of `groups` in place (FAILED ones are only named); returns `opd/*` metrics."""
        sem = asyncio.Semaphore(self.opd.score_concurrency)
        counts: dict[str, int] = {}

        async def one(i: int, s: Sample) -> None:
            name = select_teacher(s, self.opd)
            s.metadata[TEACHER_NAME_KEY] = name
            counts[name] = counts.get(name, 0) + 1
            engine = self.engines.get(name)
            if engine is None or s.status == Status.FAILED or not s.tokens:
                return
            async with sem:
                await score_sample(
                    engine,
                    s,
                    top_k=self.opd.log_prob_top_k,
                    temperature=self.temperature,
                    rid=f"{rid_prefix}-{i}",
                )

        samples = [s for g in groups for s in g]
        await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
        return {f"opd/samples_{name}": float(c) for name, c in counts.items()}

    async def close(self) -> None:
        """Close the teachers' engines."""
        for engine in self.engines.values():
            await engine.close()


async def build_teacher_engines(opd: OpdConfig, *, max_concurrency: int) -> dict[str, InferenceEngine]:
    """An engine per teacher scored on the rollout side (`capabilities().scored_in_rollout`)."""
    out: dict[str, InferenceEngine] = {}
    for name, t in opd.teachers.items():
        if t.capabilities().scored_in_rollout:
            out[name] = await t.build_engine(max_concurrency=max_concurrency)
    return out
