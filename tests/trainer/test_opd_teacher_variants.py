"""A new kind of OPD teacher is one class (with its own config) and an import path in TOML.

`CheckpointTeacher` below names its model with its own field (`weights`) and is scored on the
rollout side by an embedded engine it builds itself. `[opd.teachers.x] type =
"test_opd_teacher_variants:CheckpointTeacher"` selects it; its own problems and what its
capabilities rule out (the student-side token sets, since it scores before the trainer knows
the student's top-k) are config errors; the rollout side builds it and scores samples with it,
giving the same numbers as the built-in engine teacher on the same checkpoint.
"""

from __future__ import annotations

import asyncio

import pytest
from pydantic import Field
from train_testlib import run_dict, write_prompts

from verst.rollout.engine import InferenceEngine
from verst.rollout.errors import ConfigError, Problem
from verst.rollout.sample import Sample, Status
from verst.trainer.config import load_run_config, run_config_from_dict, validate_run_config
from verst.trainer.opd.scoring import (
    TEACHER_LOGPROBS_KEY,
    TEACHER_TOPK_IDS_KEY,
    TeacherScorer,
    build_teacher_engines,
)
from verst.trainer.opd.teachers import EngineTeacherConfig, TeacherSection, TrainerTeacherConfig
from verst.trainer.run.run_dir import to_toml

TEACHER_TYPE = f"{__name__}:CheckpointTeacher"


class CheckpointTeacher:
    """A teacher kind written here: an embedded engine on `weights`, at its own batch size."""

    class Config(TeacherSection):
        """This teacher's own `[opd.teachers.NAME]` fields."""

        type: str = Field(TEACHER_TYPE, description="This teacher's import path.")
        weights: str | None = Field(None, description="The teacher's checkpoint directory.")
        batch: int = Field(8, ge=1, description="Rows the engine decodes together.")

        def problems(self, key: str) -> list[Problem]:
            if self.weights:
                return []
            return [Problem(f"{key}.weights", "this teacher needs a checkpoint", f"set {key}.weights")]

        def model_dir(self) -> str | None:
            return self.weights

        async def build_engine(self, *, max_concurrency: int) -> InferenceEngine:
            from verst.rollout.engines.embedded.engine import EmbeddedEngine

            assert self.weights is not None
            return await asyncio.to_thread(
                EmbeddedEngine.from_pretrained, self.weights, device="cpu", max_batch_size=self.batch
            )


@pytest.fixture
def config_file(tmp_path, tiny_checkpoint):
    data = write_prompts(tmp_path / "p.jsonl", n=4)
    opd = {
        "enabled": True,
        "log_prob_top_k": 3,
        "teachers": {"x": {"type": TEACHER_TYPE, "weights": str(tiny_checkpoint), "batch": 4}},
    }
    path = tmp_path / "run.toml"
    path.write_text(to_toml(run_dict(tiny_checkpoint, data, opd=opd)), encoding="utf-8")
    return path


def test_a_teacher_from_an_import_path_is_validated_by_its_own_rules(config_file):
    cfg = load_run_config(config_file)
    teacher = cfg.opd.teachers["x"]
    assert isinstance(teacher, CheckpointTeacher.Config) and teacher.batch == 4
    validate_run_config(cfg, {}, cuda_available=False)
    # the resolved config (as a run writes it) loads back with the teacher's own fields
    (config_file.parent / "resolved.toml").write_text(to_toml(cfg.model_dump(mode="json")), encoding="utf-8")
    assert load_run_config(config_file.parent / "resolved.toml").opd.teachers["x"] == teacher

    def problems(*overrides):
        with pytest.raises(ConfigError) as info:
            validate_run_config(load_run_config(config_file, list(overrides)), {}, cuda_available=False)
        return {p.key: p for p in info.value.problems}

    got = problems('opd.teachers.x.weights=""', "opd.token_set=union")
    assert "set opd.teachers.x.weights" in got["opd.teachers.x.weights"].fix
    # its capabilities (scored on the rollout side) rule out the student-side token sets
    assert "opd.teachers.x.type = 'trainer'" in got["opd.token_set"].fix
    with pytest.raises(ConfigError) as info:
        load_run_config(config_file, ["opd.teachers.x.batchh=2"])
    assert info.value.problems[0].key == "opd.teachers.x.batchh"
    with pytest.raises(ConfigError) as info:
        load_run_config(config_file, ['opd.teachers.x.type="no_such_module:Teacher"'])
    assert info.value.problems[0].key == "opd.teachers.x.type"


def test_the_rollout_side_builds_and_scores_with_it(config_file, tiny_checkpoint):
    cfg = load_run_config(config_file)
    builtin = run_config_from_dict(
        {"opd": {**cfg.opd.model_dump(), "teachers": {"x": {"model_path": str(tiny_checkpoint)}}}}
    ).opd
    assert isinstance(builtin.teachers["x"], EngineTeacherConfig)

    async def scored(opd):
        engines = await build_teacher_engines(opd, max_concurrency=4)
        sample = Sample(prompt="x", tokens=[5, 9, 12, 7, 30, 31], response_length=3, status=Status.COMPLETED)
        scorer = TeacherScorer(opd, engines, temperature=1.0)
        try:
            await scorer.score([[sample]])
        finally:
            await scorer.close()
        return engines, sample.metadata

    engines, got = asyncio.run(scored(cfg.opd))
    assert engines["x"].max_batch_size == 4  # built by the teacher's own build_engine, from its own field
    _, want = asyncio.run(scored(builtin))
    assert len(got[TEACHER_LOGPROBS_KEY]) == 3 and got[TEACHER_LOGPROBS_KEY] == pytest.approx(
        want[TEACHER_LOGPROBS_KEY], abs=1e-5
    )
    assert got[TEACHER_TOPK_IDS_KEY] == want[TEACHER_TOPK_IDS_KEY]


def test_teachers_run_in_the_trainer_get_no_engine(tiny_checkpoint):
    from verst.trainer.opd.config import OpdConfig

    opd = OpdConfig(enabled=True, teachers={"t": TrainerTeacherConfig(model_path=str(tiny_checkpoint))})
    assert asyncio.run(build_teacher_engines(opd, max_concurrency=1)) == {}
    with pytest.raises(NotImplementedError, match="rollout-side"):
        asyncio.run(opd.teachers["t"].build_engine(max_concurrency=1))
