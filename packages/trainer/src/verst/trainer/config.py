"""The run config: `TrainConfig` and the composition `RunConfig`, loaded from TOML.

A run config is five sections — `run`, `engine`, `rollout`, `train`, `algorithm` — each owned by
the component it configures. `load_run_config` reads TOML plus `a.b.c=value` overrides and turns
pydantic's errors into `Problem`s; `validate_run_config` adds the cross-section checks (rollout
capabilities, algorithm combinations, FSDP placement) and raises every problem in ONE
`ConfigError`, before anything heavy loads.
"""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from verst.rollout.agentic.config import PER_TURN_REWARDS
from verst.rollout.config import RolloutConfig, Section, path_field
from verst.rollout.engines.config import ENGINES, EngineConfig, engine_problems
from verst.rollout.errors import ConfigError, Problem
from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.algorithms.advantages import ADVANTAGE_ESTIMATORS
from verst.trainer.algorithms.optimizer_config import AdamWSection
from verst.trainer.algorithms.rollout_correction import TokenTis
from verst.trainer.config_checks import (
    finite_problems,
    merge_problems,
    model_paths_problems,
    optimizer_problems,
    partial_run_config,
    problems_from_validation_error,
)
from verst.trainer.opd.config import OpdConfig, opd_problems
from verst.trainer.placement.layout import RaySection, placement_problems
from verst.trainer.sync.modes import WEIGHT_SYNCS, WeightSyncConfig
from verst.trainer.train.checks import layout_problems, train_problems, weight_sync_problems
from verst.trainer.train.lora import LoraSection, lora_problems
from verst.trainer.train.moe import MoeSection

__all__ = [
    "RunConfig",
    "RunSection",
    "TrainConfig",
    "apply_overrides",
    "layout_problems",
    "load_run_config",
    "parse_override",
    "problems_from_validation_error",
    "read_run_config_data",
    "resolved_model_path",
    "run_config_from_dict",
    "run_config_with_problems",
    "train_problems",
    "validate_run_config",
    "weight_sync_problems",
]


class VisionSection(Section):
    """Vision-language models (docs/vlm.md)."""

    freeze: bool = Field(
        True,
        description="Freeze the vision tower (its projector and the language model train); false = train it too.",
    )


class TrainConfig(AdamWSection):
    """The policy model, its optimizer (AdamW: `AdamWSection`'s fields) and how a step is computed."""

    model_path: str | None = path_field(
        description="Hugging Face model directory loaded with from_pretrained (None = the engine's model)."
    )
    ref_model_path: str | None = path_field(
        description="Frozen reference model for KL (None = the initial policy, model_path)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description=(
            "Compute dtype of the trained model; its parameters and optimizer state stay float32 "
            "masters (bfloat16 = bf16 autocast / FSDP2 MixedPrecisionPolicy). The reference model "
            "is stored in this dtype."
        ),
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0 over this many optimizer steps.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global gradient norm (None = off).")
    micro_batch_size: int = Field(
        8, ge=1, description="Samples per forward/backward; gradients accumulate over the rollout's samples."
    )
    num_updates_per_rollout: int = Field(
        1,
        ge=1,
        description="Optimizer steps per rollout (the rollout's samples split into equal mini-batches).",
    )
    exact_on_policy: bool = Field(
        False,
        description=(
            "Rollout log-probs equal to the trainer's bit for bit: the embedded engine and the trainer "
            "run the same batch-invariant CPU ops (verst.rollout.exact_ops; docs/training.md, Exactly "
            "on-policy). Embedded engine on CPU, float32, Llama/Mistral/Qwen2/Qwen3 and the Qwen3-MoE/"
            "Mixtral MoEs (routing replay too), LoRA without dropout, any train.layout; refused otherwise. "
            "Adds rollout/mismatch_tokens and rollout/mismatch_max per step."
        ),
    )
    logprob_backend: Literal["auto", "torch", "triton", "naive"] = Field(
        "auto",
        description=(
            "Log-prob computation: chunked verst.kernels.linear_token_logprobs ('auto' = Triton on CUDA, "
            "torch on CPU), or 'naive' full-vocabulary log_softmax (memory-hungry, for checks)."
        ),
    )
    logprob_chunk_size: int = Field(
        256, ge=1, description="Tokens per chunk of the chunked log-prob path (bounds logits memory)."
    )
    logprob_keep_logits_mib: float = Field(
        256,
        ge=0,
        description=(
            "The chunked log-prob path keeps a micro-batch's [response tokens, vocab] logits from the "
            "forward for the backward when they fit in this many MiB (the weight's dtype), skipping the "
            "backward's recompute of each chunk's logits; larger micro-batches recompute. 0 = always "
            "recompute (docs/kernels.md)."
        ),
    )
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto", description="Attention kernel: 'auto' = flash_attention_2 when installed on CUDA, else sdpa."
    )
    layout: Literal["auto", "padded", "packed", "shared_prompt"] = Field(
        "auto",
        description=(
            "How a micro-batch's sequences are laid out for the decoder: 'padded' (one right-padded "
            "row each), 'packed' (one row, positions restarting; block-diagonal mask with SDPA/eager, "
            "varlen with flash_attention_2), 'shared_prompt' (the samples of a group in one row "
            "[prompt, resp_1, ..., resp_k]: the prompt is computed once; SDPA/eager only, full-attention "
            "models; on SDPA the rows of a micro-batch may also go unpadded in one row, read by the "
            "pieces attention), or 'auto' = per micro-batch the one with the lowest estimated decoder "
            "cost (docs/training.md)."
        ),
    )
    packing: bool | None = Field(
        None,
        description=(
            "Older switch for the layout: true = layout 'packed', false = 'padded', None = train.layout "
            "decides."
        ),
    )
    fsdp: bool = Field(
        False,
        description="Shard parameters, gradients and optimizer state with FSDP2 across the launched processes.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory."
    )
    weight_sync: WeightSyncConfig = Field(
        default_factory=WEIGHT_SYNCS.build_default,
        description=(
            "How weights reach the engines after a step: a mode name or a table with `type` and the "
            "mode's own options — 'tensors' (in-process, no disk), 'disk' (HF checkpoint + "
            "update_weights_from_disk), 'distributed' (broadcast over a dedicated gloo/NCCL group to "
            "the HTTP engines; NCCL needs trainer and engines on different GPUs), 'auto' = the "
            "engine's preferred mode (tensors for the embedded engine, else disk), or 'pkg.module:Sync'."
        ),
    )
    lora: LoraSection | None = Field(
        None, description="Train a LoRA adapter on the frozen model instead of every weight (None = full)."
    )
    moe: MoeSection = Field(
        default_factory=MoeSection,
        description="Mixture-of-experts models: routing replay (R3/R2), load-balancing loss (docs/moe.md).",
    )
    vision: VisionSection = Field(
        default_factory=VisionSection, description="Vision-language models: what of the vision side trains."
    )
    seed: int = Field(0, description="Seed of torch/numpy/python RNGs on the train side.")
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (None = torch's default)."
    )

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: Any) -> Any:
        """`weight_sync_master_address` of earlier configs moves into the distributed mode's table."""
        if isinstance(data, Mapping) and "weight_sync_master_address" in data:
            data = dict(data)
            address = data.pop("weight_sync_master_address")
            mode = data.get("weight_sync", "auto")
            if mode == "distributed" or (isinstance(mode, Mapping) and mode.get("type") == "distributed"):
                table = {"type": "distributed"} if isinstance(mode, str) else dict(mode)
                data["weight_sync"] = {"master_address": address, **table}
        return data

    @property
    def effective_layout(self) -> str:
        """The layout asked for: `packing` true/false (the older switch) wins over `layout`."""
        if self.packing is None:
            return self.layout
        return "packed" if self.packing else "padded"


class RecordSection(Section):
    """What the run records for `verst dashboard` besides metrics and events (`trajectories.jsonl`)."""

    trajectories_per_step: int = Field(
        8,
        ge=0,
        description="Full trajectories (every token, mask, log-probs, advantages, segments) recorded per "
        "step and split: the lowest sample indices (0 = none besides failures).",
    )
    failed_trajectories: bool = Field(
        True, description="Also record the full trajectory of every failed or aborted sample."
    )
    max_tokens: int = Field(
        16384, ge=1, description="Token ids kept per recorded trajectory (the rest are counted, not written)."
    )


class RunSection(Section):
    """The run as a whole."""

    name: str = Field("run", description="Run name (shown in logs).")
    output_dir: str = Field("runs/run", description="Run directory: config, metrics, checkpoints, events.")
    num_steps: int = Field(10, ge=1, description="Training steps (one rollout + one train step each).")
    seed: int = Field(
        0, description="Base seed of the run (rollout sampling seeds derive from rollout.seed)."
    )
    save_interval: int = Field(0, ge=0, description="Checkpoint every N steps (0 = only at the end).")
    keep_checkpoints: int | None = Field(
        2, ge=1, description="Keep only the newest N checkpoints (None = keep all)."
    )
    resume: bool = Field(True, description="Resume from the newest complete checkpoint in the run directory.")
    save_rollouts: bool = Field(
        False,
        description="Save each step's training batch and RNG state as rollouts/step_N.pt (the newest "
        "keep_checkpoints kept) so `verst replay RUN --step N` can re-run step N bit for bit.",
    )
    placement: Literal["local", "ray"] = Field(
        "local", description="'local' = one process (or torchrun ranks); 'ray' = Ray actors."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables (win over the ambient environment)."
    )
    ray_address: str | None = Field(
        None,
        description="placement='ray': address of a running cluster ('auto', 'HOST:6379'); None = start a local one.",
    )
    ray: RaySection = Field(
        default_factory=RaySection, description="placement='ray': layout, train actors, resources."
    )
    record: RecordSection = Field(
        default_factory=RecordSection, description="Full trajectories recorded for the dashboard."
    )


class RunConfig(Section):
    """A whole run: the composition of every component's section."""

    run: RunSection = Field(default_factory=RunSection, description="The run: steps, output, checkpoints.")
    engine: EngineConfig = Field(
        default_factory=ENGINES.build_default,
        description="The inference engine(s): a table whose `type` picks the engine and its fields.",
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="How rollouts are generated.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The policy model and optimizer.")
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="Advantage estimator, policy loss, KL, entropy."
    )
    opd: OpdConfig = Field(
        default_factory=OpdConfig, description="On-policy distillation: teachers, sampled-token or top-k KL."
    )

    @model_validator(mode="after")
    def _routing_request_default(self) -> RunConfig:
        """R3 (`train.moe.routing_replay = 'rollout'`) asks the engine for its recorded experts
        (`rollout.return_routed_experts`) unless that is set explicitly."""
        if (
            self.train.moe.routing_replay == "rollout"
            and "return_routed_experts" not in self.rollout.model_fields_set
        ):
            self.rollout.return_routed_experts = True
        return self

    @model_validator(mode="after")
    def _off_policy_correction_default(self) -> RunConfig:
        """Fully-async rollout trains on samples from older weights: token-level truncated
        importance sampling (`algorithm.rollout_correction = "tis"`, earlier `algorithm.tis`) is on
        by default then. An explicit `rollout_correction` (or `tis`, true or false) wins, and
        `use_rollout_logprobs_as_old` (which makes every ratio 1) keeps it off; so does
        `max_weight_staleness = 0`, which is synchronous training (every sample on-policy)."""
        algo = self.algorithm
        if (
            self.rollout.fully_async
            and _staleness(self.rollout) > 0
            and "rollout_correction" not in algo.model_fields_set
            and not algo.use_rollout_logprobs_as_old
        ):
            algo.rollout_correction = TokenTis.Config()
        return self


def _staleness(rollout: RolloutConfig) -> int:
    """The fully-async strategy's `max_weight_staleness` (1, the default, when unreadable: the
    strategy-options check reports the bad value)."""
    from verst.rollout.strategies.fully_async_options import fully_async_options

    try:
        return fully_async_options(rollout.strategy_options).max_weight_staleness
    except ValueError:
        return 1


# ---------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """`"a.b.c=value"` → `(["a", "b", "c"], value)`; the value is parsed as TOML, else kept a string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            [Problem(text, "an override must look like 'section.key=value'", "e.g. train.lr=1e-5")]
        )
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Set each dotted key in a nested dict (creating tables as needed); returns `data`."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[path[-1]] = value
    return data


def load_run_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a TOML run config (None = all defaults) with overrides; raise one `ConfigError` on any error."""
    return run_config_from_dict(read_run_config_data(path, overrides))


def run_config_from_dict(data: Mapping[str, Any]) -> RunConfig:
    """Build a `RunConfig`; pydantic errors become one `ConfigError` of `Problem`s."""
    try:
        return RunConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(problems_from_validation_error(exc, RunConfig, data)) from None


def read_run_config_data(path: str | Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The TOML of a run config (None = empty) with the overrides applied, as a dict."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError([Problem(str(path), "config file not found", "check the path")]) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([Problem(str(path), f"not valid TOML: {exc}", "fix the TOML syntax")]) from None
    from verst.trainer.config_overrides import drop_switched_variant_keys

    file_data = copy.deepcopy(data)
    apply_overrides(data, overrides)
    drop_switched_variant_keys(RunConfig, file_data, data, [parse_override(o)[0] for o in overrides])
    return data


def run_config_with_problems(data: Mapping[str, Any]) -> tuple[RunConfig, list[Problem]]:
    """`(config, schema problems)`: the config itself when `data` validates; otherwise the
    config built from the values that did (`partial_run_config`), so the cross-section checks
    can still report with the schema problems. Raises the schema problems alone when even that
    cannot be built."""
    try:
        return run_config_from_dict(data), []
    except ConfigError as exc:
        partial = partial_run_config(data, RunConfig)
        if partial is None:
            raise
        return partial, exc.problems  # type: ignore[return-value]


# ---------------------------------------------------------------- cross-section validation


def resolved_model_path(cfg: RunConfig) -> str:
    """The model the trainer loads: train.model_path, else the engine's."""
    path = cfg.train.model_path or cfg.engine.model_path
    if path is None:
        raise ConfigError([Problem("train.model_path", "no model to train", "set train.model_path")])
    return str(path)


def validate_run_config(
    cfg: RunConfig,
    env: Mapping[str, str],
    *,
    cuda_available: bool | None = None,
    schema_problems: Sequence[Problem] = (),
    config_dir: Path | None = None,
) -> None:
    """Every cross-section check at once; raise one `ConfigError` listing each problem with its fix.

    `schema_problems` (what the schema rejected; `cfg` is then `partial_run_config`'s) are
    reported first, with the cross-section problems that do not concern the same keys.
    `config_dir` is where relative model paths may be relative to (besides the cwd).
    """
    problems: list[Problem] = list(finite_problems(cfg, ""))
    problems += optimizer_problems(cfg.train)
    problems += model_paths_problems(cfg, search_dirs=[config_dir] if config_dir else [])
    problems += engine_problems(cfg.engine, fallback_model_path=cfg.train.model_path)
    problems += list(cfg.algorithm.problems())
    episodes, estimator = cfg.rollout.env, ADVANTAGE_ESTIMATORS.get(cfg.algorithm.advantage.type)
    per_turn = episodes is not None and episodes.reward in PER_TURN_REWARDS
    if per_turn and estimator and not getattr(estimator, "per_turn", False):
        problems.append(
            Problem(
                "rollout.env.reward",
                f"{episodes.reward} rewards cannot be used by advantage {cfg.algorithm.advantage.type!r}",
                "use algorithm.advantage = 'gae' or 'grpo_per_turn', or set rollout.env.reward = 'sum'",
            )
        )
    try:
        from verst.rollout.validation import validate_rollout_config

        validate_rollout_config(cfg.rollout, env, extra_requests=cfg.opd.capability_requests())
    except ConfigError as exc:
        problems += exc.problems
    problems += opd_problems(
        cfg.opd, student_model_path=cfg.train.model_path or cfg.engine.model_path, fsdp=cfg.train.fsdp
    )
    problems += train_problems(cfg, env, cuda_available=cuda_available)
    problems += lora_problems(cfg, cfg.train.model_path or cfg.engine.model_path)
    from verst.trainer.train.moe import moe_problems

    problems += moe_problems(cfg, cfg.train.model_path or cfg.engine.model_path, config_dir)
    problems += placement_problems(cfg, env)
    problems = merge_problems(schema_problems, problems)
    if problems:
        raise ConfigError(problems)
