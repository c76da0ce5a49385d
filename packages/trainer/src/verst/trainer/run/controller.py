"""`run_training`: the training loop, reading top to bottom.

validate → build (train side, rollout side, weight sync) → maybe resume → the engines get the
trainer's weights (`WeightSync.align`: a server another run refitted holds other weights) → eval at start →
for each step: rollout → train step → weight sync → eval every `rollout.eval.interval` →
checkpoint every `run.save_interval` → metrics. SIGINT/SIGTERM finish the current step,
checkpoint and return; during a rollout they cancel it (the engine requests are aborted and its
groups handed back), checkpoint the last finished step and return within seconds. A rollout
that cannot produce its batch (`RolloutError`: an engine, generate or reward function failing
every group, every group filtered) checkpoints the same way and re-raises, so `verst train`
exits non-zero with the error and a resume loses no prompt.

The controller talks to the two sides only through their narrow interfaces (`TrainSide`,
`RolloutSide`), so they can live in other processes. With torchrun-style launches (FSDP), every
rank runs this function: rank 0 owns the rollout side, the metrics and the files; the samples of
each rollout are broadcast so every rank trains on its share.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from verst.rollout.engine import InferenceEngine
from verst.rollout.errors import RolloutError
from verst.rollout.lifecycle import JsonlSink, NoopSink
from verst.rollout.protocols import RolloutResult
from verst.trainer.config import RunConfig, resolved_model_path, validate_run_config
from verst.trainer.run.checkpoint import (
    capture_rng,
    latest_checkpoint,
    read_meta,
    restore_rng,
    save_checkpoint,
)
from verst.trainer.run.recording import RunRecorder, keyed_detail, lazy_decoder
from verst.trainer.run.rollout_side import RolloutInterrupted, RolloutSide
from verst.trainer.run.saved_batches import save_batch
from verst.trainer.run.signals import StopRequest
from verst.trainer.sync.weight_sync import WeightSync
from verst.trainer.train.batch import TrainBatch, build_train_batch
from verst.trainer.train.fsdp import DistInfo, broadcast_object, collective_device
from verst.trainer.train.side import TrainSide


@runtime_checkable
class MetricsLogger(Protocol):
    """Where metrics and progress go (`verst.trainer.run.metrics.RunLogger` writes metrics.jsonl,
    TensorBoard and a display)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record the metrics of one step."""
        ...

    def phase(self, name: str) -> None:
        """The loop entered a phase: rollout, train, sync, eval, checkpoint."""
        ...

    def close(self) -> None:
        """Flush and release."""
        ...


class InMemoryLogger:
    """Keeps every logged step in a list (the default; also handy in tests)."""

    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []
        """(step, metrics) in logging order."""
        self.phases: list[str] = []
        """Phases entered, in order."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.records.append((step, dict(metrics)))

    def phase(self, name: str) -> None:
        self.phases.append(name)

    def close(self) -> None:
        pass


@dataclass
class TrainingSummary:
    """What a run did."""

    run_dir: Path
    """The run directory."""
    start_step: int
    """The step the run started (or resumed) from."""
    steps_done: int
    """Steps completed in total (including those before a resume)."""
    weight_version: int
    """The engines' final weight version."""
    stopped_early: bool = False
    """True when a signal stopped the run before `run.num_steps`."""
    checkpoint: Path | None = None
    """The last checkpoint written."""
    last_metrics: dict[str, float] = field(default_factory=dict)
    """Metrics of the last step."""
    eval_history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    """(step, eval metrics) of every evaluation."""
    prompts: list[list[str]] = field(default_factory=list)
    """Per step of this process's run: the prompts trained on, in order (for resume checks)."""


def _eval_metrics(result: RolloutResult) -> dict[str, float]:
    return {k: v for k, v in result.metrics.items() if k.startswith("eval/")}


def _rollout_metrics(result: RolloutResult) -> dict[str, float]:
    return {(k if "/" in k else f"rollout/{k}"): float(v) for k, v in result.metrics.items()}


def build_train_side(config: RunConfig, model_path: str, env: Mapping[str, str]) -> TrainSide:
    """The local train side of a run (the loop's and `verst replay`'s: one construction)."""
    return TrainSide(
        config.train,
        config.algorithm,
        model_path=model_path,
        total_steps=config.run.num_steps,
        max_response_len=config.rollout.max_response_len,
        temperature=config.rollout.temperature,
        env=dict(env),
        opd=config.opd,
    )


class Trainer:
    """One run: builds both sides and runs the loop (`run_training` is the function form)."""

    def __init__(
        self,
        config: RunConfig,
        run_dir: str | Path,
        *,
        env: Mapping[str, str],
        logger: MetricsLogger | None = None,
        engine: InferenceEngine | None = None,
        stop: StopRequest | None = None,
    ) -> None:
        validate_run_config(config, env)
        self.config = config
        self.run_dir = Path(run_dir)
        self.env = dict(env)
        self.dist = DistInfo.from_env(env)
        self.logger = logger or InMemoryLogger()
        self.stop = stop or StopRequest()
        self.model_path = resolved_model_path(config)
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.resolved.json").write_text(config.model_dump_json(indent=2))
        torch.manual_seed(config.run.seed)
        self.sink = JsonlSink(self.run_dir / "lifecycle.jsonl") if self.dist.is_main else NoopSink()
        self.recorder = self._recorder() if self.dist.is_main else None
        """samples.jsonl, trajectories.jsonl and status.json for `verst dashboard` (main rank only)."""
        self.placement = None
        """The Ray actors and their proxies when run.placement='ray' (verst.trainer.placement)."""
        self.rollout: RolloutSide | None = None
        """The rollout side (main rank only; a proxy of the rollout actor with Ray placement)."""
        self._build_sides(engine)
        self._owns_engine = engine is None
        self.sync = WeightSync(
            self.train,
            self.rollout,
            mode=config.train.weight_sync,
            staging_dir=self.run_dir / "weights",
            dist_info=self.dist,
            shares_gpu_with_engine=config.run.placement == "ray" and config.run.ray.layout == "colocated",
        )
        self.checkpoint_dir = self.run_dir / "checkpoints"
        if config.train.lora is not None:
            from verst.trainer.sync.lora import start_adapters

            start_adapters(self.sync, config.train.lora.serve)

    def _build_sides(self, engine: InferenceEngine | None) -> None:
        """The train and rollout sides: here (`run.placement = 'local'`) or as Ray actors."""
        config = self.config
        if config.run.placement == "ray":
            if engine is not None:
                raise ValueError(
                    "run.placement='ray' builds the engines inside the rollout manager actor; "
                    "do not pass engine= (configure [engine] instead), or use run.placement='local'"
                )
            from verst.trainer.placement import build_ray_placement

            self.placement = build_ray_placement(
                config, self.run_dir, model_path=self.model_path, env=self.env, sink=self.sink
            )
            self.train, self.rollout = self.placement.train, self.placement.rollout
            return
        self.train = build_train_side(config, self.model_path, self.env)
        if self.dist.is_main:
            self.rollout = RolloutSide(
                config, model_path=self.model_path, env=self.env, sink=self.sink, engine=engine
            )

    # ------------------------------------------------------------ the loop

    def run(self) -> TrainingSummary:
        cfg = self.config
        start = self._maybe_resume()
        if start == 0 and cfg.train.lora is None:  # LoRA: `start_adapters` sent the adapter
            self.sync.align(0)  # a server another run refitted gets this run's weights back
        summary = TrainingSummary(self.run_dir, start, start, self.sync.weight_version)
        if self.recorder is not None:
            self.recorder.resumed_at(start)
        if start == 0:
            self._evaluate(0, summary, log=True)
        step = start
        with self.stop:
            while step < cfg.run.num_steps and not self.stop.requested:
                if not self._step(step, summary):
                    break
                step += 1
        interval = cfg.rollout.eval.interval
        if not self.stop.requested and step > start and (not interval or step % interval):
            self._evaluate(step, summary, log=True)  # "0 = only at start and end"; the end if not just done
        summary.stopped_early = self.stop.requested and step < cfg.run.num_steps
        summary.weight_version = self.sync.weight_version
        if self.recorder is not None:
            self.recorder.finish(stopped_early=summary.stopped_early)
        return summary

    def _step(self, step: int, summary: TrainingSummary) -> bool:
        """Train step `step` (0-based): rollout, train, sync, then eval / log / checkpoint as due.
        False when the rollout was interrupted (checkpointed; the loop ends)."""
        cfg = self.config
        t0 = time.perf_counter()
        self._phase("rollout")
        try:
            result, groups = self._shared_rollout(step)
        except RolloutInterrupted:
            summary.checkpoint = self._checkpoint(step)  # every rank: the same collectives
            return False
        except RolloutError:
            summary.checkpoint = self._checkpoint(step)  # the prompts in play were handed back
            raise
        t1 = time.perf_counter()
        self._phase("train")
        metrics, batch = self._train_and_record(step, result, groups)
        summary.prompts.append(batch.prompts)
        t2 = time.perf_counter()
        self._phase("sync")
        self.sync.push()
        t3 = time.perf_counter()
        done = step + 1
        metrics.update(_rollout_metrics(result) if result else {})
        metrics.update(
            {
                "time/rollout_s": t1 - t0,
                "time/train_s": t2 - t1,
                "time/sync_s": t3 - t2,
                "time/step_s": t3 - t0,
                "weight_version": float(self.sync.weight_version),
            }
        )
        if self.sync.last_bytes is not None:
            metrics["sync/bytes"] = float(self.sync.last_bytes)
        metrics["sync/full"] = float(self.sync.last_full)
        interval = cfg.rollout.eval.interval
        if interval and done % interval == 0:
            metrics.update(self._evaluate(done, summary, log=False))
        if self.dist.is_main:
            self.logger.log(done, metrics)
        if self.recorder is not None:
            self.recorder.step_done(done)
        summary.last_metrics = metrics
        summary.steps_done = done
        save_every = cfg.run.save_interval
        stopping = self._sync_stop()
        if (save_every and done % save_every == 0) or stopping or done == cfg.run.num_steps:
            summary.checkpoint = self._checkpoint(done)
        return True

    def close(self) -> None:
        """Close the rollout side (and its engine if built here), the sink and the logger."""
        self.sync.close()
        if self.rollout is not None:
            self.rollout.close(close_engine=self._owns_engine)
        self.sink.close()
        if self.recorder is not None:
            self.recorder.close()
        self.logger.close()
        self.train.close()

    # ------------------------------------------------------------ pieces

    def _recorder(self) -> RunRecorder:
        record = self.config.run.record

        def tokenizer() -> Any:  # loaded when the first trajectory is written
            local = getattr(self.rollout, "tokenizer", None)
            if local is not None:
                return local
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.model_path)

        return RunRecorder(
            self.run_dir,
            total_steps=self.config.run.num_steps,
            trajectories_per_step=record.trajectories_per_step,
            failed_trajectories=record.failed_trajectories,
            max_tokens=record.max_tokens,
            decode=lazy_decoder(tokenizer),
        )

    def _train_and_record(
        self, step: int, result: RolloutResult | None, groups: Any
    ) -> tuple[dict[str, float], TrainBatch]:
        """Build the batch and train on it; the main rank then records the step's samples with the
        advantages and log-probs the step used (without them when the step failed)."""
        recorder = self.recorder if result is not None else None
        chosen = None
        try:
            batch = build_train_batch(groups, reward_key=self.config.rollout.reward.key)
            if recorder is not None:
                chosen = recorder.choose(s for g in result.groups for s in g)  # type: ignore[union-attr]
                batch.record_rows = [i for i, key in enumerate(batch.sample_keys) if key in chosen]
            if self.config.run.save_rollouts and self.dist.is_main:  # for `verst replay`
                save_batch(self.run_dir, step + 1, batch, keep=self.config.run.keep_checkpoints)
            metrics = self.train.train_step(batch)
        except BaseException:
            if recorder is not None:
                recorder.record_rollout(step, result, chosen=chosen)  # type: ignore[arg-type]
            raise
        if recorder is not None:
            detail = keyed_detail(self.train.step_detail(), batch)
            recorder.record_rollout(step, result, detail, chosen)  # type: ignore[arg-type]
        return metrics, batch

    def _rollout(self, step: int) -> RolloutResult | None:
        """This rank's rollout (rank 0 only), cancelled by a stop request (the local side and the
        Ray rollout manager alike: `RolloutInterrupted`, the groups handed back)."""
        if self.rollout is None:
            return None
        return self.rollout.rollout(step, self.sync.weight_version, stop=lambda: self.stop.requested)

    def _shared_rollout(self, step: int) -> tuple[RolloutResult | None, Any]:
        """Rank 0's rollout and its groups on every rank. A rollout that fails or is stopped on
        rank 0 fails or stops every rank the same way, at once: the outcome travels in the same
        broadcast as the groups would, so no rank is left waiting for groups that never come."""
        result, error = None, None
        try:
            result = self._rollout(step)
        except (RolloutInterrupted, RolloutError) as exc:
            error = exc
        if not self.dist.distributed:
            if error is not None:
                raise error
            return result, result.groups if result else None
        if error is None:
            mine: tuple[str, Any] = ("ok", result.groups if result else None)
        else:
            kind = "stopped" if isinstance(error, RolloutInterrupted) else "failed"
            mine = (kind, f"{type(error).__name__}: {error}")
        kind, payload = broadcast_object(mine, self.dist)
        if error is not None:
            raise error
        if kind == "stopped":
            raise RolloutInterrupted(f"rank 0's rollout was stopped: {payload}")
        if kind == "failed":
            raise RolloutError(f"rank 0's rollout failed, so this rank stops too: {payload}")
        return result, payload

    def _phase(self, name: str) -> None:
        if self.dist.is_main:
            self.logger.phase(name)
        if self.recorder is not None:
            self.recorder.phase(name)

    def _evaluate(self, step: int, summary: TrainingSummary, *, log: bool) -> dict[str, float]:
        if self.rollout is None or not self.rollout.has_eval:
            return {}
        self._phase("eval")
        result = self.rollout.evaluate(step, self.sync.weight_version)
        if self.recorder is not None:
            self.recorder.record_eval(step, result)
        metrics = _eval_metrics(result)
        summary.eval_history.append((step, metrics))
        if log:
            self.logger.log(step, metrics)
        return metrics

    def _checkpoint(self, step: int) -> Path | None:
        self._phase("checkpoint")
        meta = {"weight_version": self.sync.weight_version, "rollout_id": step}
        if not self.dist.is_main:
            self.train.save(self.run_dir / "checkpoints" / f"step_{step}.tmp")  # joins the gathers only
            self._barrier()
            return None

        def write(tmp: Path) -> None:
            self.train.save(tmp)
            torch.save(
                {"rollout": self.rollout.state_dict() if self.rollout else None, "rng": capture_rng()},
                tmp / "run_state.pt",
            )

        path = save_checkpoint(self.checkpoint_dir, step, write, meta, keep=self.config.run.keep_checkpoints)
        self._barrier()
        return path

    def _sync_stop(self) -> bool:
        """Whether any rank was asked to stop; every rank then stops after this step."""
        if self.dist.distributed:
            import torch.distributed as dist

            flag = torch.tensor([1.0 if self.stop.requested else 0.0], device=collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and not self.stop.requested:
                self.stop.request("another rank was asked to stop")
        return self.stop.requested

    def _barrier(self) -> None:
        if self.dist.distributed:
            import torch.distributed as dist

            dist.barrier()

    def _maybe_resume(self) -> int:
        if not self.config.run.resume:
            return 0
        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return 0
        meta = read_meta(path)
        self.train.load(path)
        state: dict[str, Any] = torch.load(path / "run_state.pt", weights_only=False)
        if self.rollout is not None and state["rollout"] is not None:
            self.rollout.load_state_dict(state["rollout"])
        restore_rng(state["rng"])
        self.sync.align(int(meta["weight_version"]))  # whatever the engine held: the checkpoint's weights
        if self.dist.is_main:
            (self.run_dir / "resume.log").open("a").write(
                json.dumps({"resumed_from": str(path), "step": meta["step"], "time": time.time()}) + "\n"
            )
        return int(meta["step"])


def run_training(
    config: RunConfig,
    run_dir: str | Path,
    *,
    env: Mapping[str, str],
    logger: MetricsLogger | None = None,
    engine: InferenceEngine | None = None,
    stop: StopRequest | None = None,
) -> TrainingSummary:
    """Validate, build, train for `config.run.num_steps` (resuming if a checkpoint exists), close."""
    trainer = Trainer(config, run_dir, env=env, logger=logger, engine=engine, stop=stop)
    try:
        return trainer.run()
    except BaseException as exc:
        if trainer.recorder is not None:
            trainer.recorder.fail(exc)
        raise
    finally:
        trainer.close()
