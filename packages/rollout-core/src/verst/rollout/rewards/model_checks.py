"""Config checks of the model rewards (`judge`, `reward_model`), run with the other reward checks
(`verst.rollout.field_checks`): every problem with its fix, before anything loads."""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import ValidationError

from verst.rollout.config import JudgeConfig, RewardConfig
from verst.rollout.errors import Problem
from verst.rollout.rewards.judge_parsers import JUDGE_PARSERS

_KEY = "rollout.reward"


def model_reward_problems(r: RewardConfig, key: str = _KEY) -> Iterator[Problem]:
    """Problems of `<key>.judge` / `.reward_model` for `<key>.type` (`key`: `rollout.reward`, or an
    eval dataset's own reward table)."""
    if r.type == "judge" and r.judge is None:
        yield Problem(f"{key}.judge", "reward.type = 'judge' needs a judge", f"add [{key}.judge]")
    if r.type == "reward_model" and (r.reward_model is None or not r.reward_model.path):
        yield Problem(
            f"{key}.reward_model.path",
            "reward.type = 'reward_model' needs a sequence-classification checkpoint",
            f"set {key}.reward_model.path",
        )
    if r.judge is not None:
        if r.type != "judge":
            yield Problem(
                f"{key}.judge", f"set but reward.type = {r.type!r}", "set type = 'judge' or remove it"
            )
        yield from _judge_problems(r.judge, f"{key}.judge")


def _judge_problems(j: JudgeConfig, key: str) -> Iterator[Problem]:
    if (j.engine is None) == (j.url is None):
        yield Problem(key, "needs exactly one of engine and url", f"set {key}.engine (a table) or {key}.url")
    if j.parser not in JUDGE_PARSERS:
        yield Problem(f"{key}.parser", f"unknown parser {j.parser!r}", f"use one of {list(JUDGE_PARSERS)}")
    if j.parser == "number" and not j.max_score > j.min_score:
        yield Problem(f"{key}.max_score", "must exceed min_score", f"set {key}.max_score > {key}.min_score")
    if j.parser == "choice" and not j.choices:
        yield Problem(
            f"{key}.choices",
            "parser = 'choice' needs choices",
            f"set {key}.choices = {{yes = 1.0, no = 0.0}}",
        )
    fields = {"prompt": "", "response": "", "label": "", "rubric": ""}
    try:
        j.template.format_map(fields)
    except (KeyError, IndexError, ValueError) as exc:
        yield Problem(
            f"{key}.template",
            f"cannot be filled ({type(exc).__name__}: {exc})",
            "use only {prompt}, {response}, {label}, {rubric}; double other braces",
        )
    if j.engine is not None:
        from verst.rollout.engines.config import engine_problems, parse_engine_config

        try:
            engine = parse_engine_config(j.engine)
        except ValidationError as exc:
            for err in exc.errors():
                loc = ".".join(str(p) for p in err["loc"])
                yield Problem(
                    f"{key}.engine.{loc}", err["msg"], "fix the judge's engine table ([engine] fields)"
                )
            return
        yield from engine_problems(engine, key=f"{key}.engine")
