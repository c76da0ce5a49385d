"""Adapter-only refits (`[train.lora]`): the trained adapter, not the model, goes to the engine.

`tensors` (in-process): PEFT-named tensors + the adapter config to
`load_lora_adapter_from_tensors`. `disk`: a PEFT directory under `<run>/weights/v<N>/` to
`load_lora_adapter` (the previous version's folder is deleted once the new one loads). Either
way the engine is asked for the pushed weight version and reports it back (`WeightSync` checks).
`start_adapters` loads the extra served adapters (`train.lora.serve`) and the initial trained
adapter before the first rollout.
"""

from __future__ import annotations

import shutil
from typing import Any

from verst.trainer.train.lora import save_adapter


def push_adapter(sync: Any, target: int) -> int | None:
    """Send the adapter as weight version `target`; returns what the engine reports (rank 0)."""
    lora = sync.train.lora
    state = sync.train.adapter_state_for_sync()  # collective under FSDP
    sync.last_bytes = sum(t.numel() * t.element_size() for t in state.values())
    if not sync.dist.is_main or sync.rollout is None:
        return None
    if sync.mode == "tensors":
        return sync.rollout.load_lora_adapter_from_tensors(lora.name, state, lora.config, target)
    path = sync.staging_dir / f"v{target}"
    if path.exists():
        shutil.rmtree(path)
    save_adapter(path, state, lora.config)
    got = sync.rollout.load_lora_adapter(lora.name, str(path), target)
    if sync._last_dir is not None and sync._last_dir != path:
        shutil.rmtree(sync._last_dir, ignore_errors=True)
    sync._last_dir = path
    return got


def start_adapters(sync: Any, serve: dict[str, str]) -> None:
    """Load the extra served adapters (frozen, no version change), then the trained adapter at
    the engine's current version."""
    if sync.dist.is_main and sync.rollout is not None:
        for name, path in serve.items():
            sync.rollout.load_lora_adapter(name, path, None)
    sync.push(version=sync.weight_version)
