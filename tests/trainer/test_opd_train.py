"""OPD through the trainer's own paths on the real tiny model: teacher scoring on the embedded
engine, collation, the student's top-k from its hidden states, the top-k KL term and its gradient
against a float64 full-distribution reference, sampled-token advantages, and whole train steps."""

from __future__ import annotations

import asyncio
import functools
import itertools

import pytest
import torch
from test_opd_token_sets import reference_kl

from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.sample import Sample, Status
from verst.rollout.toy import make_tiny_checkpoint
from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig
from verst.trainer.opd.config import OpdConfig
from verst.trainer.opd.scoring import (
    TEACHER_LOGPROBS_KEY,
    TEACHER_NAME_KEY,
    TEACHER_TOPK_IDS_KEY,
    TEACHER_TOPK_LOGPROBS_KEY,
    TeacherScorer,
)
from verst.trainer.opd.teachers import EngineTeacherConfig, TrainerTeacherConfig
from verst.trainer.opd.token_sets import TOKEN_SET_STRATEGIES, WEIGHTINGS
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.side import TrainSide

K = 4


@pytest.fixture(scope="module")
def teacher_checkpoint(tmp_path_factory):
    """A second tiny model (other seed, wider) sharing the char tokenizer: the teacher."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("teacher") / "model", seed=11, hidden_size=64, num_layers=2
    )


def _groups(vocab: int, teacher: str | None = None) -> list[list[Sample]]:
    gen = torch.Generator().manual_seed(5)
    groups = []
    for g in range(2):
        group = []
        for j in range(2):
            p, r = 3, 2 + (g + j) % 3
            tokens = torch.randint(4, vocab, (p + r,), generator=gen).tolist()
            meta = {TEACHER_NAME_KEY: teacher} if teacher else {}
            group.append(
                Sample(
                    prompt=str(g),
                    tokens=tokens,
                    response_length=r,
                    reward=float(j % 2 + g),
                    status=Status.COMPLETED,
                    group_index=g,
                    sample_index=2 * g + j,
                    metadata=meta,
                )
            )
        groups.append(group)
    return groups


@functools.cache
def _model64(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).double().eval()


def _full_logp64(path, tokens: list[int], r: int) -> torch.Tensor:
    """float64 log-softmax over the vocabulary at the r response positions: [r, V]."""
    model = _model64(path)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]  # [L, V]
    n = len(tokens)
    return torch.log_softmax(logits[n - r - 1 : n - 1], -1)


def _side(student, opd: OpdConfig, **algo) -> TrainSide:
    torch.set_num_threads(1)
    return TrainSide(
        TrainConfig(model_path=str(student), lr=1e-3, micro_batch_size=3),
        AlgorithmConfig(**algo),
        model_path=str(student),
        total_steps=2,
        max_response_len=8,
        temperature=1.0,
        env={},
        opd=opd,
    )


def test_engine_teacher_scoring_matches_full_distribution(tiny_checkpoint, teacher_checkpoint):
    """Scored on the real embedded engine: response log-probs and top-k match float64 full logits."""
    torch.set_num_threads(1)
    opd = OpdConfig(
        enabled=True,
        log_prob_top_k=K,
        teachers={"t": EngineTeacherConfig(model_path=str(teacher_checkpoint))},
    )
    vocab = 40
    groups = _groups(vocab)
    groups[1][1].status = Status.FAILED  # not scored, but named

    async def go():
        engine = EmbeddedEngine.from_pretrained(teacher_checkpoint)
        try:
            return await TeacherScorer(opd, {"t": engine}, temperature=1.0).score(groups)
        finally:
            await engine.close()

    metrics = asyncio.run(go())
    assert metrics == {"opd/samples_t": 4.0}
    for s in itertools.chain(*groups):
        assert s.metadata[TEACHER_NAME_KEY] == "t"
        if s.status == Status.FAILED:
            assert TEACHER_LOGPROBS_KEY not in s.metadata
            continue
        ref = _full_logp64(teacher_checkpoint, s.tokens, s.response_length)  # [r, V]
        want = ref.gather(-1, torch.tensor(s.tokens[-s.response_length :])[:, None])[:, 0]
        torch.testing.assert_close(
            torch.tensor(s.metadata[TEACHER_LOGPROBS_KEY], dtype=torch.float64), want, atol=1e-4, rtol=0
        )
        top_v, top_i = torch.topk(ref, K)
        assert s.metadata[TEACHER_TOPK_IDS_KEY] == top_i.tolist()
        torch.testing.assert_close(
            torch.tensor(s.metadata[TEACHER_TOPK_LOGPROBS_KEY], dtype=torch.float64), top_v, atol=1e-4, rtol=0
        )


@pytest.mark.parametrize(
    ("strategy", "weighting"), [(s, w) for s in sorted(TOKEN_SET_STRATEGIES) for w in sorted(WEIGHTINGS)]
)
def test_topk_kl_and_grad_through_trainer_match_reference(
    tiny_checkpoint, teacher_checkpoint, strategy, weighting
):
    """Trainer teacher + the trainer's chunked top-k path vs float64 full distributions: the
    per-token KL and the gradient of its sum wrt the student's LM head."""
    opd = OpdConfig(
        enabled=True,
        log_prob_top_k=K,
        token_set=strategy,
        weighting=weighting,
        teachers={"t": TrainerTeacherConfig(model_path=str(teacher_checkpoint))},
    )
    side = _side(tiny_checkpoint, opd)
    vocab = side.bundle.hf_model.config.vocab_size
    samples = list(itertools.chain(*_groups(40, "t")))
    batch = build_train_batch([[s] for s in samples])
    inputs = side.opd.prepare(side.bundle.module, batch)
    rows = list(range(batch.num_samples))
    _, _, kl = side.opd.forward_with_kl(side.bundle.module, batch, rows, inputs)
    kl.sum().backward()
    got_grad = side.bundle.hf_model.get_output_embeddings().weight.grad.double()

    from transformers import AutoModelForCausalLM

    student64 = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).double()
    total = torch.zeros((), dtype=torch.float64)
    for i, s in enumerate(samples):
        r = s.response_length
        n = len(s.tokens)
        s_logits = student64(torch.tensor([s.tokens])).logits[0, n - r - 1 : n - 1]  # [r, V]
        t_logp = _full_logp64(teacher_checkpoint, s.tokens, r)
        want = reference_kl(s_logits.detach(), t_logp, K, strategy, weighting)
        torch.testing.assert_close(kl[i, :r].detach().double(), want, atol=2e-4, rtol=1e-4)
        assert torch.all(kl[i, r:] == 0)
        total = total + _differentiable_reference(s_logits, t_logp, K, strategy, weighting).sum()
    total.backward()
    want_grad = student64.get_output_embeddings().weight.grad
    assert got_grad.shape == (vocab, want_grad.shape[1])
    torch.testing.assert_close(got_grad, want_grad, atol=2e-4, rtol=1e-3)


def _differentiable_reference(s_logits, t_logp, k, strategy, weighting):
    """float64 `sum_S w * (log p_s - log p_t)^2 / 2` per position (weights constant): its gradient is
    the documented top-k OPD gradient `sum_S w * (log p_s - log p_t) * grad log p_s`."""
    s_full = torch.log_softmax(s_logits, -1)
    out = []
    for pos in range(s_full.shape[0]):
        s_top = set(torch.topk(s_full[pos], k).indices.tolist())
        t_top = set(torch.topk(t_logp[pos], k).indices.tolist())
        chosen = {
            "only_student": s_top,
            "only_teacher": t_top,
            "intersection": s_top & t_top,
            "union": s_top | t_top,
            "xor": s_top ^ t_top,
        }[strategy]
        total = s_full.new_zeros(())
        for v in sorted(chosen):
            ls, lt = s_full[pos, v], t_logp[pos, v]
            w = {"student": ls.detach().exp(), "teacher": lt.exp(), "uniform": torch.ones_like(ls)}[weighting]
            total = total + w.detach() * 0.5 * (ls - lt) ** 2
        out.append(total)
    return torch.stack(out)


def test_sampled_token_advantage_folding(tiny_checkpoint, teacher_checkpoint):
    """adv = task adv - coef * (student_logp - teacher_logp), with the student's pre-update log-probs;
    with_task_reward = False drops the task part."""
    for with_task in (True, False):
        opd = OpdConfig(
            enabled=True,
            coef=0.5,
            with_task_reward=with_task,
            teachers={"t": TrainerTeacherConfig(model_path=str(teacher_checkpoint))},
        )
        side = _side(tiny_checkpoint, opd)
        batch = build_train_batch(_groups(40, "t"))
        inputs = side.opd.prepare(side.bundle.module, batch)
        old = side.compute_old_logprobs(batch)
        torch.testing.assert_close(inputs.student_logprobs, old)
        task = side.algo.compute_advantages(batch.rewards, batch.loss_mask)
        got = side.opd.fold_advantages(task, batch.loss_mask, inputs)
        base = task if with_task else torch.zeros_like(task)
        want = base - 0.5 * (old - inputs.teacher_logprobs) * batch.loss_mask
        torch.testing.assert_close(got, want)
        for s_i, s in enumerate(itertools.chain(*_groups(40, "t"))):
            r = s.response_length
            ref = _full_logp64(teacher_checkpoint, s.tokens, r)
            t = ref.gather(-1, torch.tensor(s.tokens[-r:])[:, None])[:, 0]
            torch.testing.assert_close(inputs.teacher_logprobs[s_i, :r].double(), t, atol=1e-4, rtol=0)


@pytest.mark.parametrize("top_k", [0, K])
def test_train_step_with_engine_scored_teacher(tiny_checkpoint, teacher_checkpoint, top_k):
    """A whole train step on engine-scored samples: finite OPD metrics, weights move."""
    opd = OpdConfig(
        enabled=True,
        log_prob_top_k=top_k,
        token_set="intersection",
        teachers={"t": EngineTeacherConfig(model_path=str(teacher_checkpoint))},
    )
    groups = _groups(40)

    async def score():
        engine = EmbeddedEngine.from_pretrained(teacher_checkpoint)
        try:
            await TeacherScorer(opd, {"t": engine}, temperature=1.0).score(groups)
        finally:
            await engine.close()

    asyncio.run(score())
    side = _side(tiny_checkpoint, opd)
    before = side.bundle.hf_model.get_output_embeddings().weight.detach().clone()
    metrics = side.train_step(build_train_batch(groups))
    assert metrics["train/opd/distilled_tokens"] == float(sum(s.response_length for g in groups for s in g))
    assert metrics["train/opd/sampled_reverse_kl"] != 0  # a different teacher disagrees with the student
    if top_k:
        assert metrics["train/opd_topk_kl"] != 0 and torch.isfinite(
            torch.tensor(metrics["train/opd_topk_kl"])
        )
    after = side.bundle.hf_model.get_output_embeddings().weight.detach()
    assert not torch.equal(before, after)


def test_unscored_engine_samples_are_an_error(tiny_checkpoint, teacher_checkpoint):
    opd = OpdConfig(enabled=True, teachers={"t": EngineTeacherConfig(model_path=str(teacher_checkpoint))})
    side = _side(tiny_checkpoint, opd)
    with pytest.raises(ValueError, match="no teacher information"):
        side.train_step(build_train_batch(_groups(40)))
    groups = _groups(40)
    for s in itertools.chain(*groups):
        s.metadata[TEACHER_NAME_KEY] = "t"
    with pytest.raises(ValueError, match="carry no teacher log-probs"):
        side.train_step(build_train_batch(groups))
