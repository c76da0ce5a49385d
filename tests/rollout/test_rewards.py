"""Rewards: built-in rules, math answer grading, a remote reward server on loopback, custom paths."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
from aiohttp import web

from verst.rollout.config import RewardConfig, RolloutConfig
from verst.rollout.rewards import BUILTIN_REWARDS, RewardError, build_reward_fns
from verst.rollout.rewards.math_grading import extract_answer, grade_math
from verst.rollout.rewards.remote import RemoteRewardError, RemoteRewardModel
from verst.rollout.rewards.rules import exact_match, partial_credit, strip_trailing_stop
from verst.rollout.sample import Sample


def _sample(response: str, label=None, prompt="q") -> Sample:
    return Sample(prompt=prompt, response=response, label=label)


def _cfg(**reward) -> RolloutConfig:
    return RolloutConfig(reward=RewardConfig(**reward))


def test_registry_has_the_builtins():
    assert set(BUILTIN_REWARDS) == {"exact_match", "math", "partial_credit", "reasoning_gym"}


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("Paris", "paris", 1.0),
        ("  Paris.  ", "Paris", 1.0),
        ("the  answer", "The answer", 1.0),
        ("Lyon", "Paris", 0.0),
        ("42", 42, 1.0),
        ("b", ["a", "b"], 1.0),
        ("x", None, 0.0),
    ],
)
def test_exact_match(response, label, expected):
    assert exact_match(response, label) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("4321", "4321", 1.0),
        ("4311", "4321", 0.75),
        ("43", "4321", 0.5),
        ("432199", "4321", 1.0),
        ("", "4321", 0.0),
        ("1234", "4321", 0.0),
        ("", "", 1.0),
    ],
)
def test_partial_credit(response, label, expected):
    assert partial_credit(response, label) == expected


async def test_builtin_ignores_trailing_eos_and_stop():
    fn, group = build_reward_fns(RolloutConfig(stop=["###"], reward=RewardConfig(type="partial_credit")))
    assert group is None
    assert await fn(_sample("4321<eos>", "4321")) == 1.0
    assert await fn(_sample("4321###", "4321")) == 1.0
    assert await fn(_sample("4321 </s>", "4321")) == 1.0
    assert strip_trailing_stop("12<eos><eos>", ()) == "12"


@pytest.mark.parametrize(
    ("response", "label"),
    [
        ("so the result is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"),
        ("\\boxed{\\tfrac34}", "0.75"),
        ("first \\boxed{1} then \\boxed{7}", "7"),
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"),
        ("\\boxed{{1,2}}", "{1,2}"),
        ("\\boxed{x^{2}+1}", "x^{2}+1"),
        ("The answer is 1,234.", "1234"),
        ("The final answer is $12.50$.", "12.5"),
        ("Answer: 3/4", "0.75"),
        ("we get 5 apples, then 7 more, so 12", "12"),
        ("$\\boxed{5 \\text{ cm}}$", "5"),
        ("\\boxed{\\$30}", "30"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{90^\\circ}", "90"),
        ("\\boxed{x = 3}", "3"),
        ("\\boxed{-2}", "-2.0"),
        ("answer is 1000000", "1,000,000"),
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}"),
        ("\\boxed{12}", "The solution... so \\boxed{12}"),
        ("\\boxed{7}", 7),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"),
        ("\\boxed{0.3333333333}", "\\frac{1}{3}"),
    ],
)
def test_math_correct_forms(response, label):
    assert grade_math(response, label) == 1.0, (extract_answer(response), label)


@pytest.mark.parametrize(
    ("response", "label"),
    [
        ("\\boxed{41}", "42"),
        ("\\boxed{1000001}", "1000000"),
        ("\\boxed{1000000.5}", "1000000"),
        ("\\boxed{\\frac{1}{3}}", "0.33"),
        ("no answer here", "3"),
        ("\\boxed{1 unbalanced", "1"),
        ("The answer is 12", "21"),
        ("\\boxed{x+1}", "x+2"),
        ("\\boxed{5}", None),
    ],
)
def test_math_wrong_or_missing(response, label):
    assert grade_math(response, label) == 0.0


def test_extract_answer_nested_braces():
    assert extract_answer("\\boxed{\\frac{a}{b_{1}}} trailing") == "\\frac{a}{b_{1}}"
    assert extract_answer("nothing") is None


async def test_math_via_config():
    fn, _ = build_reward_fns(_cfg(type="math"))
    assert await fn(_sample("so \\boxed{6}<eos>", "6")) == 1.0


# --- remote reward model on a real loopback server -----------------------------------------


@pytest.fixture
async def reward_server():
    calls: list[dict] = []
    failures = {"n": 0}

    async def score(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append(body)
        if body["prompt"] == "flaky" and failures["n"] < 2:
            failures["n"] += 1
            return web.Response(status=503, text="warming up")
        if body["prompt"] == "bad":
            return web.json_response({"error": "bad label"}, status=400)
        if body["prompt"] == "bare":
            return web.Response(text="0.25")
        if body["prompt"] == "dict":
            return web.json_response({"reward": {"acc": 1, "fmt": 0.5}})
        return web.json_response({"reward": float(body["response"] == body["label"])})

    app = web.Application()
    app.router.add_post("/reward", score)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/reward", calls
    await runner.cleanup()


async def test_remote_reward(reward_server):
    url, calls = reward_server
    fn, _ = build_reward_fns(_cfg(type="remote", url=url, timeout_s=5))
    try:
        assert await fn(_sample("yes", "yes", prompt="p")) == 1.0
        assert await fn(_sample("no", "yes", prompt="p")) == 0.0
        assert await fn(_sample("x", prompt="bare")) == 0.25
        assert await fn(_sample("x", prompt="dict")) == {"acc": 1.0, "fmt": 0.5}
        assert calls[0] == {"prompt": "p", "response": "yes", "label": "yes"}
        # 503 twice, then success: retried.
        quick = RemoteRewardModel(url, max_retries=2, backoff_s=0.01)
        assert await quick(_sample("a", "a", prompt="flaky")) == 1.0
        await quick.aclose()
        # 4xx: not retried, the server's message surfaces.
        n = len(calls)
        with pytest.raises(RemoteRewardError, match=r"HTTP 400.*bad label"):
            await fn(_sample("a", prompt="bad"))
        assert len(calls) == n + 1
    finally:
        await fn.aclose()


async def test_remote_reward_unreachable_is_bounded():
    # A port nobody listens on: connection refused, retried max_retries times, then a clear error.
    model = RemoteRewardModel("http://127.0.0.1:9/reward", timeout_s=1, max_retries=2, backoff_s=0.01)
    try:
        with pytest.raises(RemoteRewardError, match="failed 3 times"):
            await model(_sample("x"))
    finally:
        await model.aclose()


async def test_remote_group_scores_each_member(reward_server):
    url, _ = reward_server
    fn, group = build_reward_fns(_cfg(type="remote", url=url, group=True))
    assert fn is None
    assert await group([_sample("a", "a"), _sample("b", "a")]) == [1.0, 0.0]
    await group.reward_fn.aclose()


# --- custom import paths ----------------------------------------------------------------------

CUSTOM_MODULE = textwrap.dedent(
    """
    import asyncio

    async def new_style(sample):
        return float(len(sample.response))

    def sync_new_style(sample):
        return {"len": len(sample.response), "one": 1}

    async def v1_style(args, sample):
        # slime/miles custom_rm_path signature: reads settings from args
        return float(args.n_samples_per_prompt) + (1.0 if sample.response == sample.label else 0.0)

    async def group_new(samples):
        await asyncio.sleep(0)
        return [i for i, _ in enumerate(samples)]

    def group_v1(args, samples):
        return [args.rollout_batch_size] * len(samples)

    async def raises(sample):
        raise KeyError("no such field")

    def wrong_type(sample):
        return "high"

    def group_wrong_len(samples):
        return [1.0]

    def three_args(a, b, c):
        return 0.0
    """
)


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(CUSTOM_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


async def test_custom_new_style_and_sync(custom_module):
    fn, _ = build_reward_fns(_cfg(type=f"{custom_module}:new_style"))
    assert await fn(_sample("abc")) == 3.0
    fn, _ = build_reward_fns(_cfg(type=f"{custom_module}.sync_new_style", key="len"))
    reward = await fn(_sample("ab"))
    assert reward == {"len": 2.0, "one": 1.0}
    assert Sample(reward=reward).scalar_reward("len") == 2.0


async def test_custom_v1_style_gets_args(custom_module):
    cfg = RolloutConfig(n_samples_per_prompt=4, reward=RewardConfig(type=f"{custom_module}:v1_style"))
    fn, _ = build_reward_fns(cfg)
    assert await fn(_sample("a", "a")) == 5.0


async def test_custom_group_new_and_v1(custom_module):
    _, group = build_reward_fns(_cfg(type=f"{custom_module}:group_new", group=True))
    assert await group([_sample("a")] * 3) == [0.0, 1.0, 2.0]
    cfg = RolloutConfig(batch_size=6, reward=RewardConfig(type=f"{custom_module}:group_v1", group=True))
    _, group = build_reward_fns(cfg)
    assert await group([_sample("a")] * 2) == [6.0, 6.0]


async def test_raising_custom_reward_surfaces(custom_module):
    fn, _ = build_reward_fns(_cfg(type=f"{custom_module}:raises"))
    with pytest.raises(RewardError, match=r"my_rewards:raises' raised KeyError: 'no such field'") as info:
        await fn(_sample("a"))
    assert isinstance(info.value.__cause__, KeyError)


async def test_bad_custom_results_and_signatures(custom_module):
    fn, _ = build_reward_fns(_cfg(type=f"{custom_module}:wrong_type"))
    with pytest.raises(RewardError, match="returned str"):
        await fn(_sample("a"))
    _, group = build_reward_fns(_cfg(type=f"{custom_module}:group_wrong_len", group=True))
    with pytest.raises(RewardError, match="one reward per sample"):
        await group([_sample("a"), _sample("b")])
    with pytest.raises(RewardError, match="3 required positional arguments"):
        build_reward_fns(_cfg(type=f"{custom_module}:three_args"))
    with pytest.raises(ImportError, match="has no attribute 'nope'"):
        build_reward_fns(_cfg(type=f"{custom_module}:nope"))


def test_unknown_builtin_lists_valid():
    with pytest.raises(RewardError, match=r"unknown rollout.reward.type 'exact'.*exact_match"):
        build_reward_fns(_cfg(type="exact"))


async def test_concurrent_rule_rewards_are_cheap():
    fn, _ = build_reward_fns(_cfg(type="math"))
    out = await asyncio.gather(*(fn(_sample(f"\\boxed{{{i}}}", str(i))) for i in range(200)))
    assert out == [1.0] * 200


# --- properties ---------------------------------------------------------------------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@given(st.integers(-(10**9), 10**9))
def test_math_integers_any_format(n):
    assert grade_math(f"The answer is {n:,}.", str(n)) == 1.0
    assert grade_math(f"so $\\boxed{{{n}}}$", f"{n}.0") == 1.0
    assert grade_math(f"\\boxed{{{n + 1}}}", str(n)) == 0.0


@given(st.integers(-500, 500), st.integers(1, 500))
def test_math_fractions_match_decimals(p, q):
    assert grade_math(f"\\boxed{{\\dfrac{{{p}}}{{{q}}}}}", repr(p / q)) == 1.0
    assert grade_math(f"\\boxed{{\\frac{{{p}}}{{{q}}}}}", f"{p + q}/{q}") == 0.0


@given(st.text("0123456789", max_size=12), st.text("0123456789", min_size=1, max_size=12))
def test_partial_credit_bounds(response, label):
    score = partial_credit(response, label)
    assert 0.0 <= score <= 1.0
    assert (score == 1.0) == response.startswith(label)
