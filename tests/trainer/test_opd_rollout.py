"""OPD wiring: the rollout side scores every rollout's samples after the strategy returns (default
and legacy strategies), teachers are picked per sample by metadata key, and a whole run trains."""

from __future__ import annotations

import json

import pytest
import torch
from train_testlib import run_dict, write_prompts

from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.toy import make_tiny_checkpoint
from verst.trainer.config import run_config_from_dict
from verst.trainer.opd.scoring import TEACHER_LOGPROBS_KEY, TEACHER_NAME_KEY, TEACHER_TOPK_IDS_KEY
from verst.trainer.run.controller import InMemoryLogger, run_training
from verst.trainer.run.rollout_side import RolloutSide


@pytest.fixture(scope="module")
def teacher_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("t2") / "model", seed=3, hidden_size=32, num_layers=1)


def _prompts_with_teachers(path):
    """Prompts whose metadata names a teacher for every other row (the rest use the default)."""
    with path.open("w") as fh:
        for i in range(12):
            row = {"prompt": f"{i}+{i}=", "label": str(2 * i)}
            if i % 2:
                row["metadata"] = {"teacher": "second"}
            fh.write(json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize("legacy", [False, True])
def test_rollout_side_scores_with_the_selected_teacher(tmp_path, tiny_checkpoint, teacher_checkpoint, legacy):
    if legacy:
        pytest.importorskip("verst.rollout_legacy")
    torch.set_num_threads(1)
    data = _prompts_with_teachers(tmp_path / "p.jsonl")
    teachers = {
        "first": {"model_path": str(teacher_checkpoint)},
        "second": {"model_path": str(tiny_checkpoint)},
    }
    cfg = run_config_from_dict(
        run_dict(
            tiny_checkpoint,
            data,
            opd={"enabled": True, "log_prob_top_k": 3, "teachers": teachers},
            rollout={"batch_size": 4, "n_samples_per_prompt": 2},
        )
    )
    env = {"VERST_USE_LEGACY_ROLLOUT_V1": "1"} if legacy else {}
    engines = {
        "first": EmbeddedEngine.from_pretrained(teacher_checkpoint),
        "second": EmbeddedEngine.from_pretrained(tiny_checkpoint),
    }
    side = RolloutSide(cfg, model_path=str(tiny_checkpoint), env=env, teacher_engines=engines)
    try:
        result = side.rollout(0, 0)
    finally:
        side.close()
    samples = [s for g in result.groups for s in g]
    assert len(samples) == 8
    seen = set()
    for s in samples:
        name = s.metadata[TEACHER_NAME_KEY]
        seen.add(name)
        assert name == ("second" if s.metadata.get("teacher") == "second" else "first")
        assert len(s.metadata[TEACHER_LOGPROBS_KEY]) == s.response_length
        assert all(len(row) == 3 for row in s.metadata[TEACHER_TOPK_IDS_KEY])
        if name == "second" and s.rollout_logprobs:  # the student scoring itself: same log-probs
            torch.testing.assert_close(
                torch.tensor(s.metadata[TEACHER_LOGPROBS_KEY]),
                torch.tensor(s.rollout_logprobs),
                atol=1e-4,
                rtol=0,
            )
    assert seen == {"first", "second"}
    assert result.metrics["opd/samples_first"] + result.metrics["opd/samples_second"] == 8


def test_run_training_with_engine_teacher(tmp_path, tiny_checkpoint, teacher_checkpoint):
    """`run_training` builds the teacher's engine from [opd.teachers] and trains with OPD."""
    torch.set_num_threads(1)
    data = write_prompts(tmp_path / "p.jsonl", n=8)
    cfg = run_config_from_dict(
        run_dict(
            tiny_checkpoint,
            data,
            run={"num_steps": 1},
            opd={
                "enabled": True,
                "with_task_reward": False,
                "teachers": {"t": {"model_path": str(teacher_checkpoint), "engine": {"device": "cpu"}}},
            },
        )
    )
    logger = InMemoryLogger()
    run_training(cfg, tmp_path / "run", env={}, logger=logger)
    metrics = next(m for s, m in logger.records if s == 1 and "train/loss" in m)
    assert metrics["train/opd/distilled_tokens"] > 0
    assert metrics["opd/samples_t"] == 8.0
    assert metrics["train/advantage_abs_mean"] > 0  # OPD alone still gives per-token advantages


@pytest.mark.slow
def test_served_teacher_through_the_sglang_client(tmp_path, tiny_checkpoint, teacher_checkpoint):
    """A teacher served by `verst serve`, scored through the SGLang client: same numbers as embedded."""
    import asyncio

    from verst.rollout.engines.sglang.client import SGLangClient
    from verst.rollout.engines.sglang.launcher import launch_verst_servers
    from verst.rollout.sample import Sample, Status
    from verst.trainer.opd.config import OpdConfig
    from verst.trainer.opd.scoring import TeacherScorer
    from verst.trainer.opd.teachers import EngineTeacherConfig

    opd = OpdConfig(
        enabled=True,
        log_prob_top_k=4,
        teachers={"t": EngineTeacherConfig(model_path=str(teacher_checkpoint))},
    )

    def samples():
        return [
            Sample(
                prompt="x",
                tokens=[5, 9, 12, 7, 30, 31],
                response_length=3,
                status=Status.COMPLETED,
                reward=0.0,
            )
        ]

    async def score(engine):
        got = samples()
        await TeacherScorer(opd, {"t": engine}, temperature=1.0).score([got])
        await engine.close()
        return got[0].metadata

    with launch_verst_servers(teacher_checkpoint, ready_timeout_s=300, log_dir=tmp_path / "logs") as servers:
        served = asyncio.run(score(SGLangClient(servers.urls[0])))
    local = asyncio.run(score(EmbeddedEngine.from_pretrained(teacher_checkpoint)))
    assert served[TEACHER_TOPK_IDS_KEY] == local[TEACHER_TOPK_IDS_KEY]
    torch.testing.assert_close(
        torch.tensor(served[TEACHER_LOGPROBS_KEY]),
        torch.tensor(local[TEACHER_LOGPROBS_KEY]),
        atol=1e-5,
        rtol=0,
    )
