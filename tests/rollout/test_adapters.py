"""v1-ABI user functions on the default path: the legacy adapters, V1Args, loading by path."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import v1_user_functions
from aiohttp import web
from aiohttp.test_utils import TestServer
from inference_testkit import (
    EchoGenerate,
    ListDataSource,
    ToyEngine,
    assert_attempts_closed,
    make_context,
    v1_style_echo,
)

from verst.rollout.adapters import LegacyGenerateFnAdapter, LegacyRewardFnAdapter, LegacyRolloutFnAdapter
from verst.rollout.config import RolloutConfig
from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.importing import ImportPathError
from verst.rollout.loading import adapt_v1_reward_function, load_generate_function, load_rollout_strategy
from verst.rollout.protocols import GenerateInput, RolloutRequest, RolloutStrategy
from verst.rollout.sample import Sample, Status
from verst.rollout.strategies.inference import InferenceRollout
from verst.rollout.v1_args import V1Args, build_v1_args

# --------------------------------------------------------------------------- a real engine over HTTP


def sglang_app(engine) -> web.Application:
    """SGLang's /generate (input_ids form) over an engine: what a v1 function talks to."""

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        sp = body.get("sampling_params") or {}
        params = SamplingParams(
            max_new_tokens=sp.get("max_new_tokens", 128),
            temperature=sp.get("temperature", 1.0),
            top_p=sp.get("top_p", 1.0),
            top_k=sp.get("top_k", -1),
            stop=tuple(sp.get("stop") or ()),
            stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
            sampling_seed=sp.get("sampling_seed"),
        )
        out = await engine.generate(GenerateRequest(body["input_ids"], params, rid=body.get("rid", "")))
        meta = {
            "finish_reason": {"type": out.finish_reason},
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "weight_version": str(out.weight_version),
            "output_token_logprobs": [
                [lp, t, None] for lp, t in zip(out.output_logprobs, out.output_ids, strict=True)
            ],
        }
        return web.json_response({"text": out.text, "output_ids": out.output_ids, "meta_info": meta})

    app = web.Application()
    app.router.add_post("/generate", generate)
    return app


@pytest.fixture
async def served_engine(tiny_checkpoint):
    import torch

    from verst.rollout.engines.embedded.engine import EmbeddedEngine

    torch.set_num_threads(1)
    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint, device="cpu")
    server = TestServer(sglang_app(engine), host="127.0.0.1")
    await server.start_server()
    try:
        yield (
            engine,
            {
                "hf_checkpoint": str(tiny_checkpoint),
                "sglang_router_ip": "127.0.0.1",
                "sglang_router_port": server.port,
            },
        )
    finally:
        await server.close()
        await engine.close()


def v1_context(engine, v1_args, **config):
    ctx = make_context(engine, prompts=["1+1=", "2+2=", "3+3=", "4+4=", "5+5="], max_response_len=5, **config)
    ctx.v1_args = v1_args
    ctx.data_source.labels = ["2", "4", "6", "8", "10"]
    return ctx


def check_generated(samples, max_len=5):
    for s in samples:
        s.validate()
        assert s.status.is_finished and 0 < s.response_length <= max_len
        assert len(s.rollout_logprobs) == s.response_length and all(lp <= 0 for lp in s.rollout_logprobs)
        assert s.reward in (0.0, 1.0)


@pytest.mark.timeout(120)
async def test_v1_rollout_function_runs_unchanged(served_engine):
    engine, v1_args = served_engine
    ctx = v1_context(engine, v1_args, batch_size=2, n_samples_per_prompt=2, seed=1)
    strategy = load_rollout_strategy("v1_user_functions:generate_rollout", ctx)
    assert isinstance(strategy, LegacyRolloutFnAdapter) and isinstance(strategy, RolloutStrategy)
    result = await strategy(RolloutRequest(rollout_id=0))
    assert [len(g) for g in result.groups] == [2, 2]
    check_generated([s for g in result.groups for s in g])
    assert "rollout/reward_mean" in result.metrics
    with pytest.raises(NotImplementedError):
        await strategy(RolloutRequest(rollout_id=1, evaluation=True))


@pytest.mark.timeout(120)
async def test_v1_generate_and_reward_functions_run_on_the_default_strategy(served_engine):
    engine, v1_args = served_engine
    ctx = v1_context(
        engine,
        v1_args,
        batch_size=2,
        n_samples_per_prompt=2,
        generate_function_path="v1_user_functions:generate",
    )
    ctx.reward_fn = adapt_v1_reward_function(v1_user_functions.reward, ctx.config, v1_args=v1_args)
    assert isinstance(ctx.reward_fn, LegacyRewardFnAdapter)
    strategy = InferenceRollout(ctx)
    assert isinstance(strategy.generate_fn, LegacyGenerateFnAdapter)
    assert strategy.generate_fn.args.sglang_router_port == v1_args["sglang_router_port"]
    result = await strategy(RolloutRequest(rollout_id=0))
    assert len(result.groups) == 2
    check_generated([s for g in result.groups for s in g])
    assert_attempts_closed(ctx.sink)
    assert len([e for e in ctx.sink.events if e.kind == "attempt_end"]) == 4


# --------------------------------------------------------------------------- result boxing


@dataclass
class SlimeStyleOutput:
    samples: list
    metrics: dict


def done(prompt, group_index=None, reward=1.0):
    return Sample(
        prompt=prompt,
        tokens=[1, 2],
        response_length=1,
        status=Status.COMPLETED,
        reward=reward,
        group_index=group_index,
    )


SHAPES = {
    "groups": lambda: [[done("a"), done("a")], [done("b"), done("b")]],
    "flat_with_group_index": lambda: [done("a", 7), done("b", 9), done("a", 7), done("b", 9)],
    "flat_chunked": lambda: [done("a"), done("a"), done("b"), done("b")],
    "dict_samples": lambda: {"samples": [done("a"), done("a"), done("b"), done("b")], "metrics": {"x": 1.0}},
    "dict_groups": lambda: {
        "groups": [[done("a"), done("a")], [done("b"), done("b")]],
        "metrics": {"x": 1.0},
    },
    "object": lambda: SlimeStyleOutput([[done("a"), done("a")], [done("b"), done("b")]], {"x": 1.0}),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_adapter_boxes_every_v1_result_shape(shape, kind):
    seen = {}

    def sync_fn(args, rollout_id, data_source, evaluation=False):
        seen.update(args=args, rollout_id=rollout_id, data_source=data_source)
        return SHAPES[shape]()

    async def async_fn(args, rollout_id, data_source, evaluation=False):
        return sync_fn(args, rollout_id, data_source, evaluation)

    ctx = make_context()
    adapter = LegacyRolloutFnAdapter(sync_fn if kind == "sync" else async_fn, ctx)
    result = await adapter(RolloutRequest(rollout_id=4))
    assert [[s.prompt for s in g] for g in result.groups] == [["a", "a"], ["b", "b"]]
    assert result.metrics["rollout/reward_mean"] == 1.0
    if shape.startswith("dict") or shape == "object":
        assert result.metrics["x"] == 1.0
    assert seen["rollout_id"] == 4 and seen["data_source"] is ctx.data_source
    assert isinstance(seen["args"], V1Args) and seen["args"].n_samples_per_prompt == 2


async def test_adapter_boxes_eval_results_per_dataset():
    def fn(args, rollout_id, data_source, evaluation=False):
        assert evaluation
        return {"math": {"samples": [done("a", reward=0.0), done("b", reward=1.0)]}, "code": [[done("c")]]}

    ctx = make_context(eval={"datasets": {"math": {"n_samples_per_prompt": 1}}})
    result = await LegacyRolloutFnAdapter(fn, ctx)(RolloutRequest(rollout_id=0, evaluation=True))
    assert set(result.eval) == {"math", "code"} and len(result.eval["math"]) == 2
    assert result.metrics["eval/math/reward_mean"] == 0.5 and result.metrics["eval/code/reward_mean"] == 1.0


async def test_adapter_rejects_unknown_shapes_and_eval_without_parameter():
    ctx = make_context()
    with pytest.raises(TypeError, match="expected a list of groups"):
        await LegacyRolloutFnAdapter(lambda a, r, d: 42, ctx)(RolloutRequest(rollout_id=0))
    with pytest.raises(TypeError, match="no 'evaluation' parameter"):
        await LegacyRolloutFnAdapter(lambda a, r, d: [], ctx)(RolloutRequest(rollout_id=0, evaluation=True))


# --------------------------------------------------------------------------- V1Args


def test_v1_args_mapping_and_read_only():
    cfg = RolloutConfig(
        batch_size=16,
        n_samples_per_prompt=4,
        temperature=0.7,
        top_k=20,
        max_response_len=99,
        stop=["</s>"],
        seed=5,
        partial_rollout=True,
        reward={"type": "my_pkg.rewards:score", "group": True, "key": "acc"},
        generate_function_path="my_pkg.gen:generate",
    )
    args = build_v1_args(
        cfg, hf_checkpoint="/ckpt", sglang_router_ip="10.0.0.1", sglang_router_port=30000, custom_flag=3
    )
    expected = {
        "rollout_batch_size": 16,
        "n_samples_per_prompt": 4,
        "over_sampling_batch_size": 16,
        "rollout_temperature": 0.7,
        "rollout_top_p": 1.0,
        "rollout_top_k": 20,
        "rollout_max_response_len": 99,
        "rollout_max_context_len": None,
        "rollout_stop": ["</s>"],
        "rollout_stop_token_ids": None,
        "rollout_seed": 5,
        "partial_rollout": True,
        "mask_offpolicy_in_partial_rollout": False,
        "group_rm": True,
        "rm_type": "my_pkg.rewards:score",
        "reward_key": "acc",
        "custom_generate_function_path": "my_pkg.gen:generate",
        "custom_rm_path": "my_pkg.rewards:score",
        "hf_checkpoint": "/ckpt",
        "sglang_router_ip": "10.0.0.1",
        "sglang_router_port": 30000,
        "custom_flag": 3,
    }
    for name, value in expected.items():
        assert getattr(args, name) == value, name
    assert build_v1_args(RolloutConfig()).custom_rm_path is None
    with pytest.raises(AttributeError, match="read-only"):
        args.rollout_batch_size = 3
    with pytest.raises(AttributeError, match="did you mean rollout_batch_size"):
        _ = args.rollout_batch_sizee
    assert getattr(args, "missing", "default") == "default"
    assert "rollout_seed" in args and args.to_dict()["custom_flag"] == 3


# --------------------------------------------------------------------------- loading


async def new_style(inp: GenerateInput) -> Sample:
    inp.sample.metadata["new_style"] = True
    return inp.sample


class NeedsConfig:
    def __init__(self, config):
        self.config = config

    async def __call__(self, inp):
        return inp.sample


async def two_args(args, sample):
    return sample


async def test_load_generate_function_by_signature():
    cfg = RolloutConfig()
    assert load_generate_function("test_adapters:new_style", cfg) is new_style
    assert isinstance(load_generate_function("inference_testkit:EchoGenerate", cfg), EchoGenerate)
    assert load_generate_function("test_adapters:NeedsConfig", cfg).config is cfg
    v1 = load_generate_function("inference_testkit:v1_style_echo", cfg, v1_args={"hf_checkpoint": "/x"})
    assert isinstance(v1, LegacyGenerateFnAdapter) and v1.args.hf_checkpoint == "/x"
    ctx = make_context()
    from verst.rollout.protocols import GenerateState

    state = GenerateState(ctx, 0, 0, semaphore=__import__("asyncio").Semaphore(1))
    out = await v1(GenerateInput(state, Sample(prompt="p"), SamplingParams(max_new_tokens=9)))
    assert out.metadata["v1_max_new_tokens"] == 9 and v1_style_echo.__name__ == "v1_style_echo"
    with pytest.raises(TypeError, match="2 positional arguments"):
        load_generate_function("test_adapters:two_args", cfg)


def test_bad_paths_name_the_module_and_tell_not_installed_from_broken(tmp_path, monkeypatch):
    cfg = RolloutConfig()
    with pytest.raises(ImportPathError, match="'no_such_package' is not installed"):
        load_generate_function("no_such_package.gen:generate", cfg)
    (tmp_path / "broken_user_mod.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "raising_user_mod.py").write_text("raise RuntimeError('bad config at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ImportPathError, match="fails on import because its dependency 'no_such_dependency_xyz'"
    ):
        load_generate_function("broken_user_mod:generate", cfg)
    with pytest.raises(ImportPathError, match="fails on import: RuntimeError: bad config at import"):
        load_rollout_strategy("raising_user_mod:rollout", make_context())
    with pytest.raises(ImportPathError, match="has no attribute 'nope'"):
        load_rollout_strategy("v1_user_functions:nope", make_context())
    for name in ("broken_user_mod", "raising_user_mod"):
        sys.modules.pop(name, None)


def test_load_rollout_strategy_instantiates_classes_with_the_context():
    ctx = make_context()
    strategy = load_rollout_strategy("verst.rollout.strategies.inference:InferenceRollout", ctx)
    assert isinstance(strategy, InferenceRollout) and strategy.context is ctx
    with pytest.raises(TypeError, match="v1 rollout"):
        load_rollout_strategy("inference_testkit:length_reward", ctx)


def test_testkit_datasource_and_engine_are_protocol_conformant():
    from verst.rollout.engine import InferenceEngine
    from verst.rollout.protocols import DataSource

    assert isinstance(ToyEngine(), InferenceEngine) and isinstance(ListDataSource([], 1), DataSource)
