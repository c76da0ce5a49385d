"""v1 functions written the way slime and miles users write them run unchanged (the ABI of
slime's `slime.utils.types.Sample` and its rollout functions), and a bad sample from one is an
error naming the function and the field — never a traceback deep in the trainer."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import pytest
from inference_testkit import make_context

from verst.rollout.adapters import LegacyRolloutFnAdapter
from verst.rollout.errors import RolloutFailedError
from verst.rollout.protocols import RolloutRequest
from verst.rollout.sample import Sample
from verst.rollout.strategies.inference import InferenceRollout
from verst.trainer.config import run_config_from_dict
from verst.trainer.run.rollout_side import v1_args_for

SLIME_STYLE = """
from verst.rollout.sample import Sample

async def generate(args, sample, sampling_params):
    sample.tokens = [5, 6, 7, 8]
    sample.response_length = 2
    sample.rollout_log_probs = [-0.5, -0.25]     # slime's field name
    sample.status = Sample.Status.COMPLETED      # slime's nested enum
    sample.metadata["idx"] = sample.index        # slime's name of the sample index
    return sample

async def response_only(args, sample, sampling_params):
    sample.tokens = [5, 6]
    sample.response_length = 2
    sample.status = Sample.Status.COMPLETED
    return sample

async def still_pending(args, sample, sampling_params):
    sample.tokens = [5, 6, 7]
    sample.response_length = 1
    return sample

async def no_tokens(args, sample, sampling_params):
    sample.status = Sample.Status.COMPLETED
    return sample
"""


@pytest.fixture()
def slime_module(tmp_path, monkeypatch):
    (tmp_path / "slime_style_fns.py").write_text(SLIME_STYLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "slime_style_fns"
    sys.modules.pop("slime_style_fns", None)


async def test_slime_field_names_on_sample_are_the_trainer_fields(slime_module):
    ctx = make_context(
        generate_function_path=f"{slime_module}:generate", batch_size=1, n_samples_per_prompt=2
    )
    result = await InferenceRollout(ctx)(RolloutRequest(rollout_id=0))
    for s in (s for g in result.groups for s in g):
        assert s.rollout_logprobs == [-0.5, -0.25], "TIS and the mismatch metric read what slime's name set"
        assert s.metadata["idx"] == s.sample_index
        assert s.get_reward_value(type("Args", (), {"reward_key": None})()) == s.reward
        assert s.effective_response_length == 2


@pytest.mark.parametrize(
    ("fn", "field"),
    [
        ("response_only", "Sample.tokens holds only the response"),
        ("still_pending", "Sample.status is PENDING"),
        ("no_tokens", "Sample.tokens is empty"),
    ],
)
async def test_a_bad_sample_from_a_v1_generate_function_names_the_function_and_the_field(
    slime_module, fn, field
):
    ctx = make_context(generate_function_path=f"{slime_module}:{fn}", batch_size=1, n_samples_per_prompt=1)
    with pytest.raises(RolloutFailedError) as info:
        await InferenceRollout(ctx)(RolloutRequest(rollout_id=0))
    message = str(info.value)
    assert f"{slime_module}:{fn}" in message and field in message
    assert len(info.value.errors) == 2, "a bad sample is deterministic: no resubmission"


@dataclass
class RolloutFnEvalOutput:  # slime.rollout.base_types.RolloutFnEvalOutput, field for field
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


async def test_slime_eval_rollout_return_shape_is_accepted():
    def eval_rollout(args, rollout_id, data_source, evaluation=False):
        samples = []
        for i in range(3):
            s = Sample(prompt=f"p{i}", tokens=[1, 2, 3], response_length=1, status=Sample.Status.COMPLETED)
            s.index, s.group_index = i, i
            samples.append(s)
        data = {"aime": {"rewards": [1.0, 0.0, 1.0], "truncated": [False] * 3, "samples": samples}}
        return RolloutFnEvalOutput(data=data) if evaluation else None

    ctx = make_context()
    result = await LegacyRolloutFnAdapter(eval_rollout, ctx)(RolloutRequest(rollout_id=0, evaluation=True))
    assert [[s.reward for s in g] for g in result.eval["aime"]] == [[1.0], [0.0], [1.0]]
    assert result.metrics["eval/aime/reward_mean"] == pytest.approx(2 / 3)


def test_verst_train_gives_v1_functions_args_hf_checkpoint_and_the_server(tmp_path):
    cfg = run_config_from_dict(
        {
            "train": {"model_path": str(tmp_path / "model")},
            "engine": {"type": "sglang", "urls": ["http://127.0.0.1:30123"]},
            "rollout": {"data": {"path": str(tmp_path / "d.jsonl")}},
        }
    )
    args = v1_args_for(cfg, str(tmp_path / "model"))
    assert args == {
        "hf_checkpoint": str(tmp_path / "model"),
        "sglang_router_ip": "127.0.0.1",
        "sglang_router_port": 30123,
    }
