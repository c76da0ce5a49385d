"""The critic of PPO with GAE: a value model, its optimizer and schedule, its updates and checkpoint.

`ValueModel` is a causal LM's decoder with a linear value head on the last hidden state; the
value of response token ``t`` is read at the position that predicts ``t`` (the state before the
token), through the same layouts as the policy's log-probs (`pack_sequences`, `unflatten`).
`Critic` owns it with its own AdamW, LambdaLR schedule and gradient clipping
(`[algorithm.critic]`); micro-batch size, compute dtype, gradient checkpointing and FSDP follow
`[train]`, and rows are dealt to ranks like the policy's (every rank runs the same number of
forwards; an empty micro-batch runs a dummy forward whose loss is multiplied by 0).

Per train step the train side calls `values` (all rows, no grad, before any update: ``V_old``,
the GAE input and the clipping anchor), then `update` with the GAE returns; `save` / `load`
write and read ``critic/state.pt`` inside a checkpoint (weights, optimizer, scheduler, counters),
so a resumed run continues exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verst.trainer.algorithms.aggregation import LossNorm
from verst.trainer.algorithms.critic_config import CriticConfig
from verst.trainer.algorithms.value_loss import explained_variance, value_loss
from verst.trainer.config import TrainConfig
from verst.trainer.train.batch import TrainBatch, micro_batches
from verst.trainer.train.fsdp import DistInfo, MetricSums, ensure_process_group, shard_fsdp2, sum_over_ranks
from verst.trainer.train.logprobs import PackedInputs, pack_sequences, unflatten
from verst.trainer.train.model import load_hf_model, mixed_precision_policy, resolve_attn_implementation
from verst.trainer.train.optim import adamw, backward, eval_mode, optimizer_step, trainable

_SUMMED = frozenset({"vf_loss"})
"""Already normalised by the update's LossNorm: summed over micro-batches and ranks."""


class ValueModel(nn.Module):
    """A decoder plus a linear value head: `forward(inputs)` → flat values `[num_response_tokens]`."""

    def __init__(self, policy: nn.Module, *, head_init_std: float = 0.0) -> None:
        super().__init__()
        self.policy = policy
        """The Hugging Face causal LM whose decoder runs (its LM head is unused, and frozen when untied)."""
        self.value_head = nn.Linear(policy.config.hidden_size, 1)
        if head_init_std > 0:
            nn.init.normal_(self.value_head.weight, std=head_init_std)
        else:
            nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        out, inp = policy.get_output_embeddings(), policy.get_input_embeddings()
        if out is not None and out.weight is not inp.weight:
            out.requires_grad_(False)  # untied: never in the graph, so no gradient, no optimizer state

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        """Values at the positions that predict each response token, flat `[N]` float32."""
        param = next(self.value_head.parameters())
        device = param.device
        mask = None if inputs.attention_mask is None else inputs.attention_mask.to(device)
        if mask is not None and mask.dim() == 4:  # the shared-prompt layout is never used here
            raise ValueError("the critic takes the padded or packed layout")
        out = self.policy.get_decoder()(
            input_ids=inputs.input_ids.to(device),
            position_ids=inputs.position_ids.to(device),
            attention_mask=mask,
            use_cache=False,
        )
        hidden = out.last_hidden_state  # [rows, width, H]
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, inputs.gather_index.to(device))
        return self.value_head(hidden.to(self.value_head.weight.dtype))[:, 0].float()


def _schedule_config(train: TrainConfig, cfg: CriticConfig) -> TrainConfig:
    """`lr_lambda` reads warmup / scheduler / floor from a TrainConfig: the critic's own values."""
    return train.model_copy(
        update={
            "warmup_steps": cfg.lr_warmup_steps,
            "scheduler": cfg.scheduler,
            "min_lr_ratio": cfg.min_lr_ratio,
        }
    )


class Critic:
    """The value model and what trains it (one per train side, on every rank)."""

    def __init__(
        self,
        cfg: CriticConfig,
        train: TrainConfig,
        model_path: str,
        *,
        total_steps: int,
        dist: DistInfo,
        accelerator: Any,
        packing: bool,
    ) -> None:
        """`total_steps`: optimizer steps of the whole run (the schedule's length); `accelerator`:
        the policy's (None on the direct-FSDP2 CPU path); `packing`: packed rather than padded rows."""
        self.cfg, self.train, self.dist, self.packing = cfg, train, dist, packing
        cuda = torch.cuda.is_available()
        attn = resolve_attn_implementation(train.attn_implementation, cuda=cuda)
        hf = load_hf_model(
            cfg.model_path or model_path,
            dtype="float32",
            attn_implementation=attn,
            key="algorithm.critic.model_path",
        )
        if train.gradient_checkpointing:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf.config.use_cache = False
        module = ValueModel(hf, head_init_std=cfg.head_init_std)
        self.accelerator = None
        if train.fsdp and not cuda:
            ensure_process_group(dist, cuda=False)
            shard_fsdp2(module, hf, mp_policy=mixed_precision_policy(train.dtype))
        self.optimizer: torch.optim.Optimizer
        self.optimizer, self.scheduler = adamw(
            trainable(module),
            cfg,
            fsdp=train.fsdp,
            schedule=_schedule_config(train, cfg),
            total_steps=total_steps,
        )
        self.module: nn.Module = module
        self.inner = module
        if accelerator is not None and not (train.fsdp and not cuda):
            self.accelerator = accelerator
            self.module, self.optimizer = accelerator.prepare(module, self.optimizer)
            self.inner = accelerator.unwrap_model(self.module)
        self.steps = 0
        """Train steps the critic has been updated in (the warm-up counts them)."""
        self.optimizer_steps = 0

    @property
    def warming_up(self) -> bool:
        """The policy waits: this train step is one of the first `warmup_steps`."""
        return self.steps < self.cfg.warmup_steps

    def _raw_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _forward(self, batch: TrainBatch, rows: Sequence[int]) -> torch.Tensor:
        """Values `[len(rows), R]` of `rows` (a 1-token dummy `[1, 1]` for an empty micro-batch)."""
        if not rows:
            inputs = pack_sequences([batch.tokens[0][:2]], [1], packing=True)
            return self.module(inputs)[None, :1]
        lengths = [batch.response_lengths[i] for i in rows]
        inputs = pack_sequences([batch.tokens[i] for i in rows], lengths, packing=self.packing)
        return unflatten(self.module(inputs), lengths, batch.max_response_len)

    def _micro(self, rows: Sequence[int], keys: Sequence[Any] | None) -> list[list[int]]:
        return micro_batches(
            list(rows),
            self.train.micro_batch_size,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            keys=keys,
        )

    @torch.no_grad()
    def values(self, batch: TrainBatch, keys: Sequence[Any] | None = None) -> torch.Tensor:
        """The critic's values `[B, R]` of every sample (no grad, eval mode), gathered from all ranks."""
        out = torch.zeros(batch.loss_mask.shape)
        with eval_mode(self.module):
            for mb in self._micro(range(batch.num_samples), keys):
                v = self._forward(batch, mb)
                if mb:
                    out[mb] = v.float().cpu()
        return sum_over_ranks(out, self.dist) * batch.loss_mask  # each row is filled on exactly one rank

    def update(
        self,
        batch: TrainBatch,
        updates: Sequence[Sequence[int]],
        old_values: torch.Tensor,
        returns: torch.Tensor,
        keys: Sequence[Any] | None = None,
    ) -> dict[str, float]:
        """One optimizer step per entry of `updates` (rows), on the value loss against `returns`
        (`[B, R]`); returns step metrics without prefix (``vf_loss`` averaged over the updates)."""
        self.module.train()
        mask = batch.loss_mask
        sums = MetricSums(_SUMMED)
        grad_norms = []
        for rows in updates:
            norm = LossNorm.from_masks([mask[list(rows)]], batch.max_response_len)
            for mb in self._micro(rows, keys):
                self._micro_step(batch, mb, norm, old_values, returns, sums)
            grad_norms.append(self._optimizer_step())
        out = sums.reduce(self.dist)
        n_updates = max(1, sum(1 for rows in updates if rows))
        if "vf_loss" in out:
            out["vf_loss"] /= n_updates
        out["grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
        out["lr"] = self._raw_optimizer().param_groups[0]["lr"]
        out["explained_var"] = explained_variance(old_values, returns, mask)
        self.steps += 1
        return out

    def _micro_step(
        self,
        batch: TrainBatch,
        rows: list[int],
        norm: LossNorm,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        sums: MetricSums,
    ) -> None:
        v = self._forward(batch, rows)
        if not rows:
            backward(v.sum() * 0.0, self.accelerator)
            return
        device = v.device
        m = batch.loss_mask[rows].to(device)
        out = value_loss(
            v, old_values[rows].to(device), returns[rows].to(device), m, norm, self.cfg.value_clip
        )
        backward(out.loss * self.dist.world_size, self.accelerator)
        sums.add({k: float(t) for k, t in out.metrics.items()}, float(m.sum()))

    def _optimizer_step(self) -> float:
        grad_norm = optimizer_step(self.module, self.optimizer, self.scheduler, self.cfg.max_grad_norm)
        self.optimizer_steps += 1
        return grad_norm

    # ------------------------------------------------------------ checkpoints

    def _sharded(self) -> bool:
        return self.train.fsdp

    def state(self) -> dict[str, Any]:
        """Full (unsharded) weights, optimizer, scheduler and counters; a collective under FSDP."""
        if self._sharded():
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model = get_model_state_dict(self.module, options=opts)
            optim = get_optimizer_state_dict(self.module, self._raw_optimizer(), options=opts)
        else:
            model = {k: v.detach().cpu() for k, v in self.inner.state_dict().items()}
            optim = self._raw_optimizer().state_dict()
        return {
            "model": model,
            "optimizer": optim,
            "scheduler": self.scheduler.state_dict(),
            "steps": self.steps,
            "optimizer_steps": self.optimizer_steps,
        }

    def save(self, path: str | Path) -> None:
        """Write ``critic/state.pt`` under the checkpoint folder `path` (rank 0 writes)."""
        state = self.state()
        if not self.dist.is_main:
            return
        folder = Path(path) / "critic"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(state, folder / "state.pt")

    def load(self, path: str | Path) -> None:
        """Restore what `save` wrote (every rank reads the file)."""
        file = Path(path) / "critic" / "state.pt"
        if not file.is_file():
            raise RuntimeError(
                f"{path} has no critic state ({file} is missing): it was written by a run without "
                "[algorithm.critic]; resume it without one, or start a new run directory"
            )
        state = torch.load(file, weights_only=False)
        self.load_state(state)

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Inverse of `state`."""
        if self._sharded():
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.module, dict(state["model"]), options=opts)
            set_optimizer_state_dict(self.module, self._raw_optimizer(), state["optimizer"], options=opts)
        else:
            self.inner.load_state_dict(state["model"])
            self._raw_optimizer().load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state["steps"])
        self.optimizer_steps = int(state["optimizer_steps"])
