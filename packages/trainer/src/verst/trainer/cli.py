"""The `verst` command: train, sft, eval, serve.

    verst train CONFIG.toml [section.key=value ...]   GRPO-family training (see --help for every field)
    verst sft CONFIG.toml [key=value ...]             supervised warm start (loss on response tokens)
    verst eval CONFIG.toml [CHECKPOINT]               evaluate a checkpoint on the config's eval sets
    verst serve ...                                   serve a model over SGLang's HTTP API (embedded engine)
    verst dashboard RUN_DIR... / verst report RUN_DIR -o report.html   view runs (verst.trainer.dashboard)

This is the edge of the program: it reads the environment once
(`resolve_extra_env_vars(config.run.env)`) and passes that mapping down, and it turns
configuration, data and missing-package errors into a plain message and exit code 2 — never a
traceback. Relative paths in a config resolve against the config file's folder when the file
exists there (so `verst train examples/x/config.toml` works from any directory); `run.output_dir`
is relative to the current directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from verst.rollout.config import is_path_field
from verst.rollout.errors import ConfigError, DataError, MissingOptionalDependency, Problem, RolloutError
from verst.rollout.importing import ImportPathError
from verst.trainer.config_reference import config_reference, describe_model

USER_ERRORS = (ConfigError, DataError, MissingOptionalDependency, ImportPathError)
"""Errors printed without a traceback (exit code `EXIT_USER_ERROR`): the user can fix them."""
EXIT_USER_ERROR = 2
"""Exit code of a bad config, bad data or a missing optional package."""
EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C."""
EXIT_ROLLOUT_FAILED = 3
"""Exit code of a run stopped by a `RolloutError` (a dead engine, a function that always raises,
every group filtered); the last checkpoint holds every prompt that was in play."""

# ---------------------------------------------------------------- config loading


_ENGINE_TABLE_PATH_KEYS = ("model_path", "tokenizer_path")
"""Keys of an engine kept as a plain table (`rollout.reward.judge.engine`) that are paths."""


def resolve_paths(cfg: Any, config_path: Path) -> Any:
    """Make relative paths absolute — every field declared with `path_field`, in every section
    and variant: against the config's folder when they exist there, else against the current
    directory when they exist there; otherwise leave them (a Hub model id like
    `Qwen/Qwen2.5-0.5B-Instruct`, or a file validation will report)."""
    base = config_path.resolve().parent

    def fix(value: str) -> str:
        if not value or Path(value).is_absolute():
            return value
        for candidate in (base / value, Path.cwd() / value):
            if candidate.exists():
                return str(candidate)
        return value

    def walk(node: Any) -> None:
        if isinstance(node, BaseModel):
            for name, field in type(node).model_fields.items():
                value = getattr(node, name)
                if is_path_field(field) and isinstance(value, str):
                    setattr(node, name, fix(value))
                elif is_path_field(field) and isinstance(value, dict):  # name -> path (train.lora.serve)
                    setattr(node, name, {k: fix(v) if isinstance(v, str) else v for k, v in value.items()})
                else:
                    walk(value)
        elif isinstance(node, dict):
            # an engine given as a plain table (rollout.reward.judge.engine): its *_path keys
            for key, value in list(node.items()):
                if key in _ENGINE_TABLE_PATH_KEYS and isinstance(value, str):
                    node[key] = fix(value)
                else:
                    walk(value)
        elif isinstance(node, list | tuple):
            for value in node:
                walk(value)

    walk(cfg)
    return cfg


def add_config_dir_to_path(config_path: Path) -> None:
    """Let import paths in a config name modules next to it (e.g. a custom reward file)."""
    folder = str(config_path.resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)


def load_config_and_env(config: str, overrides: Sequence[str]) -> tuple[Any, dict[str, str]]:
    """Load, resolve paths, build the effective env once, and validate (one `ConfigError`)."""
    from verst.rollout.selection import resolve_extra_env_vars
    from verst.trainer.config import read_run_config_data, run_config_with_problems, validate_run_config

    add_config_dir_to_path(Path(config))  # before loading: an engine `type` may be an import path
    cfg, schema_problems = run_config_with_problems(read_run_config_data(config, list(overrides)))
    cfg = resolve_paths(cfg, Path(config))
    env = resolve_extra_env_vars(cfg.run.env)
    validate_run_config(
        cfg, env, schema_problems=schema_problems, config_dir=Path(config).resolve().parent
    )  # schema and cross-section problems together, before anything is created
    return cfg, env


# ---------------------------------------------------------------- commands


def cmd_train(args: argparse.Namespace) -> int:
    """`verst train`: validate, prepare the run directory, train, draw the curves."""
    cfg, env = load_config_and_env(args.config, args.overrides)
    from verst.trainer.run.controller import run_training
    from verst.trainer.run.metrics import RunLogger
    from verst.trainer.run.run_dir import RunDir

    fresh = not Path(cfg.run.output_dir).exists()
    run_dir = RunDir(Path(cfg.run.output_dir)).create()
    header = f"# resolved config of run {cfg.run.name!r}\n# from {args.config} {' '.join(args.overrides)}"
    run_dir.write_config(cfg, header=header)
    logger = RunLogger(
        run_dir,
        total_steps=cfg.run.num_steps,
        env=env,
        run_name=cfg.run.name,
        config=cfg.model_dump(mode="json"),
    )
    logger.message(f"verst train: run {cfg.run.name!r} → {run_dir.root}")
    try:
        summary = run_training(cfg, run_dir.root, env=env, logger=logger)
    except USER_ERRORS:
        logger.close()
        if fresh:  # a problem found only while building: no half-made run directory stays behind
            remove_unstarted_run_dir(run_dir)
        raise
    finally:
        logger.close()
    summary = summary_dict(summary)
    summary["phase_seconds"] = {k: round(v, 3) for k, v in logger.phase_seconds.items()}
    run_dir.write_summary(summary)
    print(_format_summary(summary, run_dir), flush=True)
    return 0


def remove_unstarted_run_dir(run_dir: Any) -> None:
    """Delete a run directory this command created when no checkpoint was written in it (the
    run failed while building, on a user error such as a model that does not load)."""
    import shutil

    if not any(run_dir.checkpoints.iterdir()):
        shutil.rmtree(run_dir.root, ignore_errors=True)


def summary_dict(summary: Any) -> dict[str, Any]:
    """A JSON-friendly dict of the controller's `TrainingSummary`, with the eval rewards pulled out."""
    out = dataclasses.asdict(summary) if dataclasses.is_dataclass(summary) else dict(summary or {})
    out.pop("prompts", None)
    history = out.get("eval_history") or []
    rewards = [(step, _eval_reward(m)) for step, m in history]
    rewards = [(step, r) for step, r in rewards if r is not None]
    if rewards:
        out["initial_eval_reward"] = rewards[0][1]
        out["final_eval_reward"] = rewards[-1][1]
        out["eval_reward_gain"] = rewards[-1][1] - rewards[0][1]
    return out


def _eval_reward(metrics: dict[str, float]) -> float | None:
    from verst.trainer.run.progress import EVAL_KEYS, _first

    return _first(metrics, EVAL_KEYS, None)


def _format_summary(summary: dict[str, Any], run_dir: Any) -> str:
    lines = [f"run finished: {run_dir.root}"]
    for key in (
        "steps_done",
        "initial_eval_reward",
        "final_eval_reward",
        "eval_reward_gain",
        "stopped_early",
    ):
        if key in summary:
            value = summary[key]
            lines.append(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
    lines.append(f"  curves: {run_dir.curves}   metrics: {run_dir.metrics}")
    lines.append(f"  tensorboard --logdir {run_dir.tensorboard}")
    return "\n".join(lines)


def cmd_sft(args: argparse.Namespace) -> int:
    """`verst sft`: supervised warm start."""
    from pydantic import ValidationError

    from verst.trainer.config import parse_override
    from verst.trainer.config_checks import problems_from_validation_error
    from verst.trainer.train.sft import SftConfig, load_sft_config, run_sft

    overrides = {}
    for text in args.overrides:
        path, value = parse_override(text)
        overrides[path[-1] if path[0] == "sft" else ".".join(path)] = value
    try:
        cfg = load_sft_config(args.config, overrides)
    except FileNotFoundError:
        raise ConfigError([Problem(args.config, "config file not found", "check the path")]) from None
    except ValidationError as exc:
        raise ConfigError(problems_from_validation_error(exc, SftConfig)) from None
    summary = run_sft(cfg, log=lambda step, m: print(f"sft step {step}/{cfg.steps}: " + _fmt(m), flush=True))
    print(
        f"sft finished: {summary['output_dir']} (final loss {summary['final_loss']:.4f}, {summary['seconds']:.0f}s)"
    )
    return 0


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def checkpoint_model_dir(path: str | Path) -> Path:
    """A model directory from a HF model folder, a run checkpoint (`step_N/model`), or a run
    directory (its newest checkpoint)."""
    from verst.trainer.run.checkpoint import latest_checkpoint

    path = Path(path).resolve()
    if (path / "config.json").exists():
        return path
    if (path / "model" / "config.json").exists():
        return path / "model"
    newest = latest_checkpoint(path / "checkpoints") if (path / "checkpoints").is_dir() else None
    if newest is not None and (newest / "model" / "config.json").exists():
        return newest / "model"
    raise ConfigError(
        [
            Problem(
                "checkpoint",
                f"{path} holds no model (no config.json, no model/config.json, no checkpoints/step_N/)",
                "pass a Hugging Face model folder, a run checkpoint folder, or a run directory",
            )
        ]
    )


def cmd_eval(args: argparse.Namespace) -> int:
    """`verst eval`: evaluate the config's model (or CHECKPOINT) on `rollout.eval.datasets`."""
    overrides = list(args.overrides)
    if args.checkpoint:
        model = checkpoint_model_dir(args.checkpoint)
        overrides += [f'train.model_path="{model}"', f'engine.model_path="{model}"']
    cfg, env = load_config_and_env(args.config, overrides)
    if not cfg.rollout.eval.datasets:
        raise ConfigError(
            [
                Problem(
                    "rollout.eval.datasets", "no eval datasets", "add a [rollout.eval.datasets.<name>] table"
                )
            ]
        )
    from verst.trainer.config import resolved_model_path
    from verst.trainer.run.rollout_side import RolloutSide

    side = RolloutSide(cfg, model_path=resolved_model_path(cfg), env=env)
    try:
        metrics = dict(side.evaluate(0, side.weight_version()).metrics)
    finally:
        side.close()
    print(json.dumps({"model": resolved_model_path(cfg), **metrics}, indent=2))
    return 0


def cmd_serve(argv: Sequence[str]) -> int:
    """`verst serve`: delegate to the engine server's own argument parser."""
    from verst.rollout.engines.serve.server import main as serve_main

    return int(serve_main(list(argv)) or 0)


# ---------------------------------------------------------------- entry point


def build_parser(*, with_reference: bool = True) -> argparse.ArgumentParser:
    """The argument parser; `train --help` ends with the full config reference (built only if asked)."""
    parser = argparse.ArgumentParser(
        prog="verst", description="verst: reinforcement-learning post-training for LLMs."
    )
    sub = parser.add_subparsers(
        dest="command", metavar="{train,sft,eval,serve,dashboard,report,export,replay}"
    )
    fmt = argparse.RawDescriptionHelpFormatter
    train = sub.add_parser(
        "train",
        help="train a policy with GRPO-family RL",
        formatter_class=fmt,
        description="Train from a TOML config; key=value arguments override fields (e.g. train.lr=1e-5).",
        epilog=config_reference() if with_reference else None,
    )
    train.add_argument("config", help="the run config (TOML)")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides (values parsed as TOML)")
    sft = sub.add_parser(
        "sft",
        help="supervised fine-tuning (warm start)",
        formatter_class=fmt,
        epilog=_sft_reference() if with_reference else None,
    )
    sft.add_argument("config", help="the SFT config (TOML, fields at the top level or under [sft])")
    sft.add_argument("overrides", nargs="*", help="key=value overrides")
    ev = sub.add_parser("eval", help="evaluate a checkpoint on the config's eval sets")
    ev.add_argument("config", help="the run config (TOML)")
    ev.add_argument("checkpoint", nargs="?", help="model directory to evaluate (default: the config's model)")
    ev.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value override")
    sub.add_parser(
        "serve", help="serve a model over SGLang's HTTP API (args: verst serve --help)", add_help=False
    )
    from verst.trainer.dashboard.cli import add_subcommands as add_dashboard_commands

    add_dashboard_commands(sub)  # dashboard, report (each sets args.func)
    export = sub.add_parser("export", help="write a run's newest checkpoint as a HF model or PEFT adapter")
    export.add_argument("run_dir", help="the run directory (run.output_dir)")
    export.add_argument("--merge", action="store_true", help="LoRA: fold the adapter into the base weights")
    export.add_argument(
        "--out",
        default=None,
        help="output folder: new, empty, or an earlier export, which is replaced (default RUN_DIR/export/<kind>)",
    )
    export.set_defaults(func=cmd_export)
    replay = sub.add_parser(
        "replay",
        help="re-run train step N from checkpoint N-1 and check it reproduces checkpoint N bit for bit",
        description="Re-runs train step N from checkpoint N-1 on the step's saved batch (written when the "
        "run had run.save_rollouts=true) and compares weights and optimizer state with checkpoint N. "
        "Exit 0 when bit-equal; 1 with the differing tensors (name, max abs diff) when not.",
    )
    replay.add_argument("run_dir", help="the run directory (run.output_dir)")
    replay.add_argument("--step", type=int, required=True, help="the step N to replay (1 = the first)")
    replay.set_defaults(func=cmd_replay)
    return parser


def cmd_replay(args: argparse.Namespace) -> int:
    """`verst replay`: re-run one train step and report whether it is bit-equal to its checkpoint."""
    from verst.rollout.selection import resolve_extra_env_vars
    from verst.trainer.config import RunConfig
    from verst.trainer.run.replay import replay_step

    resolved = Path(args.run_dir) / "config.resolved.json"
    if not resolved.is_file():
        raise ConfigError(
            [
                Problem(
                    "run_dir",
                    f"{args.run_dir} is not a run directory (no config.resolved.json)",
                    "pass run.output_dir of a run",
                )
            ]
        )
    env = resolve_extra_env_vars(RunConfig.model_validate_json(resolved.read_text()).run.env)
    report = replay_step(args.run_dir, args.step, env=env)
    print("\n".join(report.lines()), flush=True)
    return 0 if report.equal else 1


def cmd_export(args: argparse.Namespace) -> int:
    """`verst export`: the adapter (or, with --merge, a merged model) of a run's newest checkpoint."""
    from verst.trainer.run.export import export_run

    print(export_run(args.run_dir, args.out, merge=args.merge))
    return 0


def _sft_reference() -> str:
    from verst.trainer.train.sft import SftConfig

    return "\n".join(["SFT config fields:", *describe_model(SftConfig)])


def print_user_error(exc: BaseException, *, stream: Any = None) -> None:
    """Print a user-facing error without a traceback."""
    stream = stream or sys.stderr
    kind = {ConfigError: "configuration error", DataError: "data error"}.get(type(exc), "error")
    if isinstance(exc, MissingOptionalDependency):
        kind = "missing optional dependency"
    print(f"verst: {kind}:\n{exc}", file=stream, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `verst` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return _guarded(lambda: cmd_serve(argv[1:]))
    parser = build_parser(with_reference=bool({"-h", "--help"} & set(argv)))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USER_ERROR
    commands = {"train": cmd_train, "sft": cmd_sft, "eval": cmd_eval}
    return _guarded(lambda: commands[args.command](args) if args.command in commands else args.func(args))


def _guarded(fn: Any) -> int:
    try:
        return int(fn() or 0)
    except USER_ERRORS as exc:
        print_user_error(exc)
        return EXIT_USER_ERROR
    except RolloutError as exc:
        print(f"verst: run stopped: {type(exc).__name__}:\n{exc}", file=sys.stderr, flush=True)
        return EXIT_ROLLOUT_FAILED
    except KeyboardInterrupt:
        print("verst: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
