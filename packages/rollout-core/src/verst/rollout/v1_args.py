"""`args` for v1 functions: a read-only namespace under the names slime and miles users write.

v1 user functions (`generate_rollout(args, rollout_id, data_source, evaluation=False)`,
`async generate(args, sample, sampling_params)`, `async reward(args, sample)`) read their
settings from an argparse namespace. The adapters hand them a `V1Args` built from the typed
config instead. It is read-only: setting an attribute raises (a v1 function that used `args`
as a scratchpad must keep its state elsewhere), because the config is the one source of truth.

| config key (`rollout.` section)        | v1 name                              |
|----------------------------------------|--------------------------------------|
| `batch_size`                           | `rollout_batch_size`                 |
| `n_samples_per_prompt`                 | `n_samples_per_prompt`               |
| `over_sampling_batch_size` (or batch)  | `over_sampling_batch_size`           |
| `temperature`                          | `rollout_temperature`                |
| `top_p`                                | `rollout_top_p`                      |
| `top_k`                                | `rollout_top_k`                      |
| `max_response_len`                     | `rollout_max_response_len`           |
| `max_context_len`                      | `rollout_max_context_len`            |
| `stop`                                 | `rollout_stop` (list, None if empty) |
| `stop_token_ids`                       | `rollout_stop_token_ids` (ditto)     |
| `seed`                                 | `rollout_seed`                       |
| `partial_rollout`                      | `partial_rollout`                    |
| `mask_offpolicy_in_partial_rollout`    | `mask_offpolicy_in_partial_rollout`  |
| `reward.group`                         | `group_rm`                           |
| `reward.type`                          | `rm_type`                            |
| `reward.key`                           | `reward_key`                         |
| `reward.url`                           | `rm_url`                             |
| `reward.type` when an import path      | `custom_rm_path` (else None)         |
| `generate_function_path`               | `custom_generate_function_path`      |
| `rollout_function_path`                | `rollout_function_path`              |
| `dynamic_filters`                      | `dynamic_sampling_filter_path` (first, or None) |
| `max_concurrency`                      | `sglang_server_concurrency`          |
| `data.apply_chat_template`             | `apply_chat_template`                |
| `data.input_key` / `label_key` / `metadata_key` | `input_key` / `label_key` / `metadata_key` |
| `data.shuffle`                         | `rollout_shuffle`                    |
| `eval.temperature`                     | `eval_temperature`                   |
| `eval.max_response_len`                | `eval_max_response_len`              |
| keyword `hf_checkpoint`                | `hf_checkpoint`                      |
| keyword `sglang_router_ip` / `_port`   | `sglang_router_ip` / `sglang_router_port` |
| any other keyword                      | its own name                         |
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any

from verst.rollout.config import RolloutConfig


class V1Args:
    """A read-only attribute namespace (what `argparse.Namespace` was for v1 functions)."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        try:
            return values[name]
        except KeyError:
            close = difflib.get_close_matches(name, values, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise AttributeError(
                f"v1 args has no setting {name!r}{hint} (pass extra settings to build_v1_args(**extra))"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"v1 args are read-only (tried to set {name!r}); they mirror the typed rollout config: "
            f"change the config instead, or keep per-call state in the sample's metadata"
        )

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"v1 args are read-only (tried to delete {name!r})")

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, V1Args) and self._values == other._values

    def __hash__(self) -> int:
        return id(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (V1Args, (self._values,))

    def to_dict(self) -> dict[str, Any]:
        """A plain copy of every setting."""
        return dict(self._values)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"V1Args({inner})"


def _is_import_path(value: str) -> bool:
    return ":" in value or "." in value


def build_v1_args(
    config: RolloutConfig,
    *,
    hf_checkpoint: str | None = None,
    sglang_router_ip: str | None = None,
    sglang_router_port: int | None = None,
    **extra: Any,
) -> V1Args:
    """The v1 `args` for `config` (see the module docstring for the mapping)."""
    reward = config.reward
    values: dict[str, Any] = {
        "rollout_batch_size": config.batch_size,
        "n_samples_per_prompt": config.n_samples_per_prompt,
        "over_sampling_batch_size": config.effective_over_sampling_batch_size,
        "rollout_temperature": config.temperature,
        "rollout_top_p": config.top_p,
        "rollout_top_k": config.top_k,
        "rollout_max_response_len": config.max_response_len,
        "rollout_max_context_len": config.max_context_len,
        "rollout_stop": list(config.stop) or None,
        "rollout_stop_token_ids": list(config.stop_token_ids) or None,
        "rollout_seed": config.seed,
        "partial_rollout": config.partial_rollout,
        "mask_offpolicy_in_partial_rollout": config.mask_offpolicy_in_partial_rollout,
        "group_rm": reward.group,
        "rm_type": reward.type,
        "reward_key": reward.key,
        "rm_url": reward.url,
        "custom_rm_path": reward.type if _is_import_path(reward.type) else None,
        "custom_generate_function_path": config.generate_function_path,
        "rollout_function_path": config.rollout_function_path,
        "dynamic_sampling_filter_path": config.dynamic_filters[0] if config.dynamic_filters else None,
        "sglang_server_concurrency": config.max_concurrency,
        "apply_chat_template": config.data.apply_chat_template,
        "input_key": config.data.input_key,
        "label_key": config.data.label_key,
        "metadata_key": config.data.metadata_key,
        "rollout_shuffle": config.data.shuffle,
        "eval_temperature": config.eval.temperature,
        "eval_max_response_len": config.eval.max_response_len,
        "hf_checkpoint": hf_checkpoint,
        "sglang_router_ip": sglang_router_ip,
        "sglang_router_port": sglang_router_port,
    }
    values.update(extra)
    return V1Args(values)
