"""The trainer's own config checks: FSDP placement, model path, attention kernel, sequence
layout, batch splits, weight sync against the engine (`validate_run_config` runs them with the
other sections' checks). Light: imports neither torch nor transformers until a check needs them,
and no config module at run time (it is handed the validated config).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from verst.rollout.errors import Problem

if TYPE_CHECKING:
    from verst.rollout.engines.config import EngineSection
    from verst.trainer.config import RunConfig, TrainConfig


def flash_attn_2_available() -> bool:
    """transformers' own check: the `flash-attn` (2.x) distribution, not just a `flash_attn` module.

    The sglang extra installs `flash-attn-4`, whose `flash_attn/cute/` makes `flash_attn` a
    namespace package, so `importlib.util.find_spec("flash_attn")` is true although transformers
    cannot load `flash_attention_2` from it.
    """
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())


def resolve_attn_implementation(requested: str, *, cuda: bool) -> str:
    """'auto' → flash_attention_2 when transformers can use flash-attn 2 on CUDA, else sdpa."""
    if requested != "auto":
        return requested
    if cuda and flash_attn_2_available():
        return "flash_attention_2"
    return "sdpa"


def train_problems(
    cfg: RunConfig, env: Mapping[str, str], *, cuda_available: bool | None = None
) -> list[Problem]:
    """Trainer checks: FSDP placement, model path, attention kernel, batch splits."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    problems = []
    world_size = int(env.get("WORLD_SIZE", "1") or 1)
    if cfg.run.placement == "ray":
        world_size = 2  # Ray starts the train actors; FSDP placement is checked by placement_problems
    if cfg.train.fsdp and not cuda_available and world_size < 2:
        problems.append(
            Problem(
                "train.fsdp",
                "FSDP on CPU with a single process would run unsharded (accelerate ignores its FSDP "
                "plugin on CPU, and one process has nothing to shard across)",
                "launch 2+ processes, e.g. `torchrun --nproc_per_node 2 -m verst.trainer.cli train CONFIG`, "
                "or set train.fsdp=false",
            )
        )
    if cfg.train.model_path is None and cfg.engine.model_path is None:
        problems.append(
            Problem("train.model_path", "no model to train", "set train.model_path (or engine.model_path)")
        )
    if cfg.train.attn_implementation == "flash_attention_2" and (
        not cuda_available or not flash_attn_2_available()
    ):
        problems.append(
            Problem(
                "train.attn_implementation",
                "flash_attention_2 needs CUDA and the flash-attn 2 package as transformers "
                "detects it (the flash-attn-4 that the sglang extra installs does not count)",
                "use 'auto' or 'sdpa' (verst ships no flash-attn extra: its 2.8.3 sdist does not "
                "build against torch >= 2.13); a flash-attn 2 wheel matching your torch/CUDA, "
                "installed by hand, is picked up by 'auto'",
            )
        )
    problems += layout_problems(cfg.train, cuda_available=cuda_available)
    samples = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    if samples % cfg.train.num_updates_per_rollout:
        problems.append(
            Problem(
                "train.num_updates_per_rollout",
                f"the rollout's {samples} samples do not split into {cfg.train.num_updates_per_rollout} "
                "equal mini-batches",
                "choose a divisor of rollout.batch_size * rollout.n_samples_per_prompt",
            )
        )
    problems += weight_sync_problems(cfg.train, cfg.engine)
    from verst.trainer.train.exact_checks import exact_on_policy_problems

    problems += exact_on_policy_problems(cfg, cuda_available=cuda_available, world_size=world_size)
    return problems


def layout_problems(train: TrainConfig, *, cuda_available: bool) -> list[Problem]:
    """`train.packing` against `train.layout`, and shared prompts against flash-attention 2."""
    problems = []
    if train.packing is not None and train.layout not in ("auto", train.effective_layout):
        problems.append(
            Problem(
                "train.packing",
                f"train.packing={str(train.packing).lower()} means layout {train.effective_layout!r}, "
                f"but train.layout={train.layout!r}",
                "remove train.packing (train.layout replaces it) or make the two agree",
            )
        )
    shared = train.effective_layout == "shared_prompt"
    if (
        shared
        and resolve_attn_implementation(train.attn_implementation, cuda=cuda_available) == "flash_attention_2"
    ):
        problems.append(
            Problem(
                "train.layout",
                "'shared_prompt' needs a custom attention mask, which flash_attention_2 does not take",
                "use train.layout='auto' or 'packed' with flash_attention_2, or "
                "train.attn_implementation='sdpa'",
            )
        )
    return problems


def weight_sync_problems(train: TrainConfig, engine: EngineSection) -> list[Problem]:
    """`train.weight_sync` against what the engine accepts (the mode asks its capabilities)."""
    return train.weight_sync.problems(
        "train.weight_sync", engine.capabilities(), f"engine.type={engine.type!r}"
    )
