"""The train side's weights and state: the full weights for a refit (`state_dict_for_sync`,
gathered under FSDP), the LoRA adapter's tensors, a Hugging Face export (`save_hf`), and the
checkpoint of model, optimizer, scheduler and counters (`save` / `load`; with PPO's critic its
`critic/state.pt` too). Mixed into `TrainSide`.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from verst.trainer.sync.plan import ShipPlan, apply_plan, planned_nbytes, static_names
from verst.trainer.train.hf_keys import to_model_keys
from verst.trainer.train.optim import with_run_flags


class TrainStateMixin:
    """Weights out and state in/out of `TrainSide` (its `bundle`, `lora`, `dist`, counters)."""

    bundle: Any
    lora: Any
    dist: Any
    critic: Any
    """PPO's value model (`train.critic.Critic`) or None; its state is saved and loaded with the policy's."""
    model_path: str
    optimizer_steps: int

    def state_dict_for_sync(self, plan: ShipPlan | None = None) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights with the Hugging Face names; a collective under FSDP.
        With a `plan` (a refit's): its names left out, float32 cast to its dtype.

        Under FSDP only rank 0 receives tensors (the others get an empty dict).
        """
        if self.bundle.sharding == "none":
            return apply_plan({k: v.detach() for k, v in self.bundle.hf_model.state_dict().items()}, plan)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(
            self.bundle.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return apply_plan({k.removeprefix("policy."): v for k, v in sd.items()}, plan)

    def static_names(self) -> tuple[frozenset[str], frozenset[str]]:
        """(frozen, tied aliases) among the weights' names (`verst.trainer.sync.plan`)."""
        return static_names(self.bundle.hf_model)

    def save_hf(self, path: str | Path, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        """Write the current weights as a Hugging Face checkpoint (config, weights, tokenizer)."""
        sd = dict(state_dict) if state_dict is not None else self.state_dict_for_sync()
        if not self.dist.is_main:
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.bundle.hf_model.save_pretrained(path, state_dict=sd)
        source = Path(self.model_path)
        for name in source.iterdir() if source.is_dir() else ():
            wanted = "token" in name.name or name.name in (
                "generation_config.json",
                "preprocessor_config.json",
            )
            if name.is_file() and wanted and not (path / name.name).exists():
                shutil.copy2(name, path / name.name)

    def _optimizer_state(self) -> dict[str, Any]:
        if self.bundle.sharding == "none":
            return self.bundle.raw_optimizer().state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            self.bundle.module,
            self.bundle.raw_optimizer(),
            options=StateDictOptions(full_state_dict=True, cpu_offload=True),
        )

    def state_nbytes(self, plan: ShipPlan | None = None) -> int:
        """Bytes of the weights a refit with `plan` ships (counted from the model, no gather)."""
        return planned_nbytes(self.bundle.hf_model.state_dict(), plan)

    def adapter_state_for_sync(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's tensors (PEFT names), gathered whole; a collective under FSDP (only
        rank 0 receives tensors)."""
        assert self.lora is not None
        return self.lora.state(is_main=self.dist.is_main)

    def save(self, path: str | Path) -> None:
        """Model (HF layout; with LoRA the adapter only), optimizer, scheduler and counters into
        `path` (a collective under FSDP)."""
        path = Path(path)
        sd = self.state_dict_for_sync() if self.lora is None else self.adapter_state_for_sync()
        opt = self._optimizer_state()
        if self.critic is not None:  # a collective under FSDP too; rank 0 writes critic/
            self.critic.save(path)
        if not self.dist.is_main:
            return
        if self.lora is not None:
            self.lora.save(path / "adapter", sd)
        else:
            self.save_hf(path / "model", sd)
        torch.save(
            {
                "optimizer": opt,
                "scheduler": self.bundle.raw_scheduler().state_dict(),
                "optimizer_steps": self.optimizer_steps,
            },
            path / "train_state.pt",
        )

    def load(self, path: str | Path) -> None:
        """Restore what `save` wrote (every rank reads the files), the critic's state included."""
        self._load_policy(Path(path))
        if self.critic is not None:
            self.critic.load(path)

    def _load_policy(self, path: Path) -> None:
        from safetensors.torch import load_file

        state = torch.load(path / "train_state.pt", weights_only=False)
        if self.lora is not None:
            self.lora.load(path / "adapter")
            self._load_optimizer(state["optimizer"])
            self.bundle.raw_scheduler().load_state_dict(state["scheduler"])
            self.optimizer_steps = int(state["optimizer_steps"])
            return
        if (path / "adapter").is_dir():
            raise RuntimeError(
                f"{path} is a LoRA checkpoint (adapter only); resume it with the run's [train.lora], "
                "or start a new run directory"
            )
        sd: dict[str, torch.Tensor] = {}
        for f in sorted((path / "model").glob("*.safetensors")):
            sd.update(load_file(f))
        sd = to_model_keys(self.bundle.hf_model, sd)  # on disk MoE experts are per expert
        if self.bundle.sharding == "none":
            missing, unexpected = self.bundle.hf_model.load_state_dict(sd, strict=False)
            tied = (
                {"lm_head.weight"}
                if getattr(self.bundle.hf_model.config, "tie_word_embeddings", False)
                else set()
            )
            if unexpected or set(missing) - tied:
                raise RuntimeError(
                    f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}"
                )
            self._load_optimizer(state["optimizer"])
        else:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.bundle.module, {f"policy.{k}": v for k, v in sd.items()}, options=opts)
            set_optimizer_state_dict(
                self.bundle.module,
                self.bundle.raw_optimizer(),
                with_run_flags(state["optimizer"], self.bundle.raw_optimizer()),
                options=opts,
            )
        self.bundle.raw_scheduler().load_state_dict(state["scheduler"])
        self.optimizer_steps = int(state["optimizer_steps"])

    def _load_optimizer(self, state: dict[str, Any]) -> None:
        """The saved optimizer state, keeping this run's `fused` / `foreach` flags."""
        state = with_run_flags(state, self.bundle.raw_optimizer())
        if self.bundle.sharding == "none":
            self.bundle.raw_optimizer().load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            self.bundle.module,
            self.bundle.raw_optimizer(),
            state,
            options=StateDictOptions(full_state_dict=True),
        )
