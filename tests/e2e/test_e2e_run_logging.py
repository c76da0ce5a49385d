"""The run directory pieces: resolved config TOML, metrics sinks, progress display, curves."""

from __future__ import annotations

import io
import json
import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.errors import MissingOptionalDependency
from verst.trainer.config import RunConfig, load_run_config
from verst.trainer.run.curves import PANELS, pick_metric, plot_curves
from verst.trainer.run.metrics import RunLogger, wandb_enabled
from verst.trainer.run.progress import ProgressDisplay, format_duration
from verst.trainer.run.run_dir import RunDir, to_toml

keys = st.text("abcdefghij_-.", min_size=1, max_size=8)
scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.lists(st.integers(-100, 100), max_size=4),
)
tables = st.recursive(
    st.dictionaries(keys, scalars, max_size=4),
    lambda inner: st.dictionaries(keys, inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(tables)
def test_to_toml_round_trips(data):
    """Whatever nested tables of scalars we write, tomllib reads back the same (empty tables aside)."""

    def prune(d):
        return {k: prune(v) if isinstance(v, dict) else v for k, v in d.items()}

    assert tomllib.loads(to_toml(data)) == prune(data)


def test_resolved_config_reloads_to_the_same_config(tmp_path):
    cfg = load_run_config(
        None, ["train.lr=3e-4", "rollout.eval.datasets.heldout.path='x.jsonl'", "run.env.A='1'"]
    )
    run_dir = RunDir(tmp_path / "run").create()
    run_dir.write_config(cfg, header="# resolved")
    again = load_run_config(run_dir.config)
    assert again == cfg
    assert again.train.lr == 3e-4 and again.rollout.eval.datasets["heldout"].path == "x.jsonl"


def test_run_logger_writes_jsonl_tensorboard_and_curves(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    stream = io.StringIO()
    with RunLogger(run_dir, total_steps=3, progress=ProgressDisplay(3, stream=stream, live=False)) as logger:
        for step in range(1, 4):
            for phase in ("rollout", "train", "sync"):
                logger.phase(phase)
            logger.log(
                step, {"rollout/reward_mean": 0.1 * step, "train/kl": 0.0, "train/entropy": 1.5, "bad": "x"}
            )
        logger.log(3, {"eval/reward_mean": 0.9})
    rows = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 3]
    assert rows[1]["rollout/reward_mean"] == pytest.approx(0.2) and "bad" not in rows[1]
    assert any(p.name.startswith("events.out.tfevents") for p in run_dir.tensorboard.iterdir())
    assert run_dir.curves.stat().st_size > 10_000
    assert set(logger.phase_seconds) >= {"rollout", "train", "sync"}
    lines = stream.getvalue().splitlines()
    assert (
        len(lines) == 4
        and "step 3/3" in lines[-1]
        and "eval 0.900" in lines[-1]
        and "\r" not in stream.getvalue()
    )


def test_tensorboard_events_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = RunDir(tmp_path / "run")
    with RunLogger(
        run_dir, total_steps=2, progress=ProgressDisplay(2, stream=io.StringIO()), curves=False
    ) as lg:
        lg.log(1, {"rollout/reward_mean": 0.25})
        lg.log(2, {"rollout/reward_mean": 0.5})
    acc = EventAccumulator(str(run_dir.tensorboard)).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")] == [(1, 0.25), (2, 0.5)]


def test_wandb_is_lazy_and_says_how_to_install(tmp_path):
    assert not wandb_enabled({}) and not wandb_enabled({"WANDB_PROJECT": "p", "WANDB_MODE": "disabled"})
    pytest.importorskip("pytest")  # keep the import order explicit
    try:
        import wandb  # noqa: F401

        pytest.skip("wandb is installed here; the not-installed message cannot be tested")
    except ModuleNotFoundError:
        pass
    with pytest.raises(MissingOptionalDependency, match="uv sync --extra wandb"):
        RunLogger(
            RunDir(tmp_path / "r"),
            total_steps=1,
            env={"WANDB_PROJECT": "p"},
            progress=ProgressDisplay(1, stream=io.StringIO()),
        )


def test_progress_eta_and_live_line():
    now = [0.0]
    stream = io.StringIO()
    progress = ProgressDisplay(10, stream=stream, live=True, clock=lambda: now[0])
    assert progress.eta_seconds() is None
    progress.phase("rollout")
    now[0] = 20.0
    progress.log(2, {"rollout/reward_mean": 0.5})
    assert progress.eta_seconds() == pytest.approx(80.0)
    progress.phase("train")
    assert "\r" in stream.getvalue() and "train" in progress.line() and "eta 1m20s" in progress.line()
    progress.close()
    assert stream.getvalue().endswith("\n")
    assert format_duration(59) == "59s" and format_duration(3720) == "1h02m"


def test_curves_mark_missing_metrics_and_pick_aliases(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1, "reward": 0.3}) + "\n" + '{"step": 2, "rew')
    assert pick_metric([{"step": 1, "reward": 0.3}], PANELS[0][1]) == "reward"
    out = plot_curves(path, tmp_path / "c.png")
    assert out.stat().st_size > 10_000


def test_every_config_section_round_trips_defaults(tmp_path):
    run_dir = RunDir(tmp_path).create()
    run_dir.write_config(RunConfig())
    assert load_run_config(run_dir.config) == RunConfig()
