"""The rollout section of the run config: one typed schema, loaded from TOML.

Field docs (the `description=`s) are what `verst train --help` prints. Cross-field checks and
the capability check against the selected strategy live in `verst.rollout.validation`, which
reports every problem in one `ConfigError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from verst.rollout.agentic.config import EnvConfig
from verst.rollout.sandbox.config import SandboxConfig


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, fields are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


CONFIG_PATH = "config_path"
"""`json_schema_extra` flag of a field holding a file or folder path: relative paths resolve
against the config file's folder (`verst.trainer.cli.resolve_paths` walks every section)."""


def path_field(default: Any = None, *, description: str) -> Any:
    """A `Field` holding a path that resolves against the config file's folder."""
    return Field(default, description=description, json_schema_extra={CONFIG_PATH: True})


def is_path_field(field: Any) -> bool:
    """True for a field declared with `path_field`."""
    extra = getattr(field, "json_schema_extra", None)
    return isinstance(extra, dict) and bool(extra.get(CONFIG_PATH))


class DataConfig(Section):
    """A prompt dataset (JSONL or Parquet), or a generated source (`source`)."""

    source: str = Field(
        "file",
        description="Where prompts come from: 'file' (path), 'reasoning_gym' (procedural tasks), or an import "
        "path 'pkg.module:Class' of a data source (docs/environments.md).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="A generated source's own options (e.g. reasoning_gym: dataset, config, seed).",
    )
    path: str | None = path_field(description="JSONL or Parquet file of prompts.")
    input_key: str = Field("prompt", description="Row key holding the prompt (text or chat messages).")
    label_key: str | None = Field(
        "label", description="Row key holding the reference answer (None = no label)."
    )
    metadata_key: str | None = Field(
        "metadata", description="Row key holding a dict copied into sample.metadata."
    )
    apply_chat_template: bool = Field(False, description="Render prompts with the tokenizer's chat template.")
    image_key: str = Field(
        "images",
        description="Row key holding the prompt's images (paths, base64 or data URLs; docs/vlm.md).",
    )
    image_dir: str | None = path_field(
        None, description="Folder base64 images are written to (None = '<data file>.images/' beside it)."
    )
    shuffle: bool = Field(True, description="Shuffle prompts every epoch.")
    seed: int = Field(0, description="Seed of the per-epoch shuffle.")


DEFAULT_JUDGE_TEMPLATE = "{rubric}\nQuestion: {prompt}\nReference: {label}\nAnswer: {response}\nVerdict:"
"""The judge prompt unless `rollout.reward.judge.template` is set (docs/rewards.md)."""


class JudgeConfig(Section):
    """A judge model scoring answers (`rollout.reward.type = 'judge'`; docs/rewards.md)."""

    engine: dict[str, Any] | None = Field(
        None,
        description=(
            "The judge's own engine: a table with the [engine] fields (type embedded, sglang, vllm, ...). "
            "Never refit with the policy. Exactly one of engine and url."
        ),
    )
    url: str | None = Field(
        None, description="An OpenAI-compatible server (e.g. 'http://127.0.0.1:8000/v1'; `verst serve`)."
    )
    model: str = Field("judge", description="The `model` field sent to an OpenAI-compatible url.")
    tokenizer_path: str | None = path_field(
        None, description="Tokenizer of an engine judge (None = engine.tokenizer_path or engine.model_path)."
    )
    template: str = Field(
        DEFAULT_JUDGE_TEMPLATE,
        description="Judge prompt with {prompt}, {response}, {label} and {rubric} (docs/rewards.md).",
    )
    rubric: str = Field("Is the answer correct?", description="Filled into the template's {rubric}.")
    parser: str = Field(
        "number", description="How the verdict becomes a score: number, choice or yes_no_logprob."
    )
    min_score: float = Field(0.0, description="parser = number: the lowest valid number (maps to 0).")
    max_score: float = Field(10.0, description="parser = number: the highest valid number (maps to 1).")
    choices: dict[str, float] = Field(
        default_factory=lambda: {"yes": 1.0, "no": 0.0},
        description="parser = choice: each allowed verdict word and its score.",
    )
    yes: str = Field("yes", description="parser = yes_no_logprob: the 'yes' token's text.")
    no: str = Field("no", description="parser = yes_no_logprob: the 'no' token's text.")
    max_new_tokens: int = Field(16, ge=1, description="Verdict length (yes_no_logprob reads one token).")
    max_concurrency: int = Field(16, ge=1, description="Judge calls in flight at once.")
    timeout_s: float = Field(30.0, gt=0, description="Bound of one judge call (a timeout is a reward error).")
    cache: bool = Field(
        True, description="Reuse a verdict for the same (judge, template, inputs) within a run."
    )


class RewardModelConfig(Section):
    """A sequence-classification reward model (`rollout.reward.type = 'reward_model'`)."""

    path: str | None = path_field(None, description="AutoModelForSequenceClassification checkpoint.")
    device: str = Field("cpu", description="Device of the reward model (cpu, cuda, cuda:1, ...).")
    batch_size: int = Field(16, ge=1, description="(prompt, response) pairs scored per forward.")
    batch_wait_ms: float = Field(5.0, ge=0, description="How long a batch waits for more pairs.")
    max_length: int = Field(1024, ge=8, description="Tokens per pair (longer pairs are cut from the left).")
    label_index: int | None = Field(
        None, description="Score = softmax prob of this label (None = the single logit, num_labels = 1)."
    )


class RewardConfig(Section):
    """How samples are scored."""

    type: str = Field(
        "exact_match",
        description="A built-in reward (exact_match, math, partial_credit, reasoning_gym), 'code_tests' / 'code_tests_binary' (the row's tests run in the sandbox, docs/code.md), 'remote', 'judge', 'reward_model', or an import path 'pkg.module:fn'.",
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig,
        description="The code sandbox of type = 'code_tests' / 'code_tests_binary' (limits, workers).",
    )
    judge: JudgeConfig | None = Field(None, description="The judge (type = 'judge').")
    reward_model: RewardModelConfig | None = Field(
        None, description="The reward model (type = 'reward_model')."
    )
    url: str | None = Field(None, description="Remote reward model URL (type = 'remote').")
    timeout_s: float = Field(30.0, gt=0, description="Timeout of one remote reward call.")
    group: bool = Field(
        False, description="Score whole groups at once (the reward fn takes a list of samples)."
    )
    key: str | None = Field(
        None, description="For dict rewards: the key the trainer optimises (slime's reward_key)."
    )


class EvalDatasetConfig(DataConfig):
    """A named eval dataset."""

    shuffle: bool = Field(False, description="Eval sets are not shuffled by default.")
    n_samples_per_prompt: int = Field(1, ge=1, description="Samples per eval prompt.")
    reward: RewardConfig | None = Field(
        None,
        description="This set's own reward, a table like rollout.reward (None = rollout.reward): e.g. "
        "a rule scoring held-out data of a run trained against a judge (docs/rewards.md).",
    )


class EvalConfig(Section):
    """Evaluation rollouts."""

    datasets: dict[str, EvalDatasetConfig] = Field(default_factory=dict, description="Eval sets by name.")
    interval: int = Field(0, ge=0, description="Evaluate every N training steps (0 = only at start and end).")
    temperature: float = Field(0.0, ge=0, description="Eval sampling temperature (0 = greedy).")
    max_response_len: int | None = Field(None, ge=1, description="Eval max new tokens (None = rollout's).")


class RolloutConfig(Section):
    """How rollouts are generated."""

    batch_size: int = Field(
        8, ge=1, description="Groups (prompts) kept per rollout (slime's rollout_batch_size)."
    )
    n_samples_per_prompt: int = Field(8, ge=1, description="Samples per prompt (the GRPO group size).")
    over_sampling_batch_size: int | None = Field(
        None, ge=1, description="Groups submitted per wave while filling the batch (None = batch_size)."
    )
    max_concurrency: int = Field(64, ge=1, description="Engine requests in flight at once.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Top-k sampling (-1 = off).")
    max_response_len: int = Field(128, ge=1, description="Max new tokens per sample.")
    max_context_len: int | None = Field(
        None, ge=1, description="Max prompt + response tokens (None = model's)."
    )
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    seed: int | None = Field(
        None, description="Base sampling seed (per-sample seeds derive from it); None = random."
    )
    generate_function_path: str | None = Field(
        None, description="Import path of a custom generate function (new-style or v1 signature)."
    )
    rollout_function_path: str | None = Field(
        None,
        description="Import path of a custom strategy class or v1 rollout function; overrides the default.",
    )
    strategy_options: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Options of the selected strategy, validated up front against its `Options` model (a "
            "custom strategy declares its own typed options; see strategy_options())."
        ),
    )
    dynamic_filters: list[str] = Field(
        default_factory=list,
        description="Group filters applied while over-sampling: nonzero_std, no_aborted, or import paths.",
    )
    max_group_retries: int = Field(2, ge=0, description="Resubmissions of a group whose generation raised.")
    max_waves_per_rollout: int | None = Field(
        None,
        ge=1,
        description="Waves one rollout may pull before it stops with the groups it kept (None = 10 × the waves one batch needs).",
    )
    partial_rollout: bool = Field(
        False, description="Keep aborted partial samples and resume them next rollout."
    )
    mask_offpolicy_in_partial_rollout: bool = Field(
        False, description="Loss-mask the part of a resumed response generated under older weights."
    )
    fully_async: bool = Field(
        False,
        description=(
            "Generate continuously while training (FullyAsyncRollout); its options "
            "(max_weight_staleness, async_buffer_groups, stale_policy) go in rollout.strategy_options."
        ),
    )
    lora_key: str = Field(
        "lora",
        description="sample.metadata key naming the LoRA adapter that generates a sample (multi-LoRA); "
        "samples without it use the trained adapter (or the base model without [train.lora]).",
    )
    return_routed_experts: bool = Field(
        False,
        description=(
            "Ask the engine for the MoE experts it chose at every position (Sample.routed_experts); "
            "on by itself with train.moe.routing_replay = 'rollout'. Needs an engine with the "
            "routing_replay capability and an MoE model (docs/moe.md)."
        ),
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Training prompts.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward function.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation.")
    env: EnvConfig | None = Field(
        None, description="Agentic multi-turn episodes in an environment (None = single-turn generation)."
    )

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: Any) -> Any:
        """Flat fully-async keys of earlier configs move into `strategy_options`."""
        return migrate_fully_async_keys(data) if isinstance(data, Mapping) else data

    @property
    def effective_over_sampling_batch_size(self) -> int:
        """Groups submitted per wave."""
        return self.over_sampling_batch_size or self.batch_size


FULLY_ASYNC_KEYS = ("max_weight_staleness", "async_buffer_groups", "stale_policy")
"""Flat `[rollout]` keys of earlier configs that are now the fully-async strategy's options
(`verst.rollout.strategies.fully_async_options.FullyAsyncOptions`)."""


def migrate_fully_async_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """A `[rollout]` table with the flat fully-async keys of earlier configs moved into
    `strategy_options` (an option set there wins). Without `fully_async = true` they are
    dropped: nothing read them then."""
    data = dict(data)
    flat = {k: data.pop(k) for k in FULLY_ASYNC_KEYS if k in data}
    if flat and data.get("fully_async") is True:
        options = data.get("strategy_options")
        data["strategy_options"] = {**flat, **(options if isinstance(options, Mapping) else {})}
    return data
