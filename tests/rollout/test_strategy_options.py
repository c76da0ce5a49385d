"""A strategy declares its own typed options (`Options`); `rollout.strategy_options` is checked
against them before anything loads, and the strategy reads them validated."""

from __future__ import annotations

from typing import ClassVar, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from verst.rollout.config import DataConfig, RolloutConfig
from verst.rollout.errors import ConfigError
from verst.rollout.protocols import Capability, strategy_options
from verst.rollout.validation import validate_rollout_config

PATH = f"{__name__}:ReplayingRollout"


class ReplayingRollout:
    """A custom strategy (constructor and call elided: only its options matter here)."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset({Capability.EVAL})

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        replay_groups: int = Field(2, ge=0, description="Groups replayed from the previous rollout.")
        order: Literal["oldest", "newest"] = Field("oldest", description="Which groups replay first.")


def _config(tmp_path, **kw) -> RolloutConfig:
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return RolloutConfig(data=DataConfig(path=str(data)), **kw)


def test_typed_options_reach_the_strategy(tmp_path):
    cfg = _config(tmp_path, rollout_function_path=PATH, strategy_options={"replay_groups": 5})
    validate_rollout_config(cfg, {})
    options = strategy_options(ReplayingRollout, cfg)
    assert (options.replay_groups, options.order) == (5, "oldest")


def test_bad_options_are_config_problems(tmp_path):
    cfg = _config(
        tmp_path, rollout_function_path=PATH, strategy_options={"replay_groups": -1, "ordr": "newest"}
    )
    with pytest.raises(ConfigError) as err:
        validate_rollout_config(cfg, {})
    got = {p.key: p for p in err.value.problems}
    assert set(got) == {"rollout.strategy_options.replay_groups", "rollout.strategy_options.ordr"}
    assert "order" in got["rollout.strategy_options.ordr"].fix  # lists the strategy's options


def test_options_for_a_strategy_without_options(tmp_path):
    with pytest.raises(ConfigError) as err:
        validate_rollout_config(_config(tmp_path, strategy_options={"replay_groups": 1}), {})
    (problem,) = err.value.problems
    assert problem.key == "rollout.strategy_options" and "takes no options" in problem.why


def test_fully_async_options_are_the_strategys_own_and_old_flat_keys_still_load(tmp_path):
    """`max_weight_staleness`, `async_buffer_groups` and `stale_policy` are `FullyAsyncRollout`'s
    options; the flat `[rollout]` keys of earlier configs move into `strategy_options`."""
    from verst.rollout.strategies.fully_async import FullyAsyncRollout

    new = _config(
        tmp_path,
        fully_async=True,
        batch_size=2,
        strategy_options={"max_weight_staleness": 0, "async_buffer_groups": 4, "stale_policy": "drop"},
    )
    validate_rollout_config(new, {})
    options = strategy_options(FullyAsyncRollout, new)
    assert (options.max_weight_staleness, options.async_buffer_groups, options.stale_policy) == (0, 4, "drop")
    old = _config(tmp_path, fully_async=True, batch_size=2, max_weight_staleness=0, async_buffer_groups=4)
    assert old.strategy_options == {"max_weight_staleness": 0, "async_buffer_groups": 4}
    both = _config(
        tmp_path, fully_async=True, max_weight_staleness=3, strategy_options={"max_weight_staleness": 2}
    )
    assert both.strategy_options == {"max_weight_staleness": 2}  # the strategy's own table wins
    # without fully_async nothing read them: dropped, and the default strategy takes no options
    sync = _config(tmp_path, max_weight_staleness=0, stale_policy="drop")
    assert sync.strategy_options == {}
    validate_rollout_config(sync, {})
    # their checks name the new keys
    bad = _config(tmp_path, fully_async=True, batch_size=8, async_buffer_groups=4, stale_policy="never")
    with pytest.raises(ConfigError) as err:
        validate_rollout_config(bad, {})
    got = {p.key: p for p in err.value.problems}
    assert set(got) == {
        "rollout.strategy_options.stale_policy",
        "rollout.strategy_options.async_buffer_groups",
    }
    assert "retry" in got["rollout.strategy_options.stale_policy"].why
    assert "cannot hold one batch" in got["rollout.strategy_options.async_buffer_groups"].why
