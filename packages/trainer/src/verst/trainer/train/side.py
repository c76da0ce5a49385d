"""`TrainSide`: the policy, its reference, optimizer and scheduler, and one train step.

The controller talks to it only through `train_step`, `compute_old_logprobs`,
`state_dict_for_sync`, `save` / `load` and `close` — a surface narrow enough for a Ray actor
(or each torchrun rank) to implement. Every rank holds the whole (small) `TrainBatch`; rows are
dealt to ranks in even chunks and each rank runs the same number of micro-batches, so FSDP
collectives line up. The loss of each micro-batch is normalised by the step-global `LossNorm`
and multiplied by the world size (FSDP/DDP average gradients), so gradient accumulation over
micro-batches and ranks equals the full-batch gradient.

The forwards and the no-grad log-prob passes are in `train.passes`, the weights out and the
checkpoints in `train.state` (both mixed in); what every update shares with the critic's
(AdamW, backward, optimizer step) in `train.optim`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from verst.rollout.errors import ConfigError, Problem
from verst.trainer.algorithms import AlgorithmConfig, LossNorm, build_algorithm
from verst.trainer.algorithms.aggregation import Aggregation
from verst.trainer.algorithms.terms import LossTerm, compose, to_floats
from verst.trainer.config import TrainConfig
from verst.trainer.opd.config import OpdConfig
from verst.trainer.opd.train import OpdTrainer
from verst.trainer.train.batch import TrainBatch
from verst.trainer.train.checks import resolve_attn_implementation
from verst.trainer.train.critic import Critic
from verst.trainer.train.exact_tally import MismatchTally
from verst.trainer.train.fsdp import DistInfo, MetricSums
from verst.trainer.train.logprobs import PolicyLogprobs
from verst.trainer.train.lora import LoraState
from verst.trainer.train.model import build_policy, build_reference
from verst.trainer.train.moe import MoeAuxTerm, outside_clip
from verst.trainer.train.moe_runtime import MoeRuntime
from verst.trainer.train.optim import backward, optimizer_step
from verst.trainer.train.passes import ForwardPassesMixin
from verst.trainer.train.plan import MicroBatch, StepPlan
from verst.trainer.train.state import TrainStateMixin
from verst.trainer.train.step_detail import StepDetailCollector, StepRowDetail

_SUMMED = frozenset({"loss", "pg_loss", "kl_loss"})
"""Algorithm metrics already normalised by the mini-batch's LossNorm: summed over its micro-batches
(and ranks) to that update's loss, then averaged over the `num_updates_per_rollout` updates."""


@dataclass(frozen=True, slots=True)
class _StepTensors:
    """Whole-batch tensors of one train step (`[B, R]`, CPU), sliced per micro-batch."""

    advantages: torch.Tensor
    old: torch.Tensor | None
    """Precomputed old log-probs (None = the micro-step's own detached log-probs)."""
    ref: torch.Tensor | None
    rollout: torch.Tensor | None
    values: torch.Tensor | None = None
    """The critic's values before the step's updates (PPO with GAE; else None)."""
    returns: torch.Tensor | None = None
    """The critic's targets (GAE returns; with `values`)."""


class StepExtension(Protocol):
    """Something that joins every train step besides the algorithm (on-policy distillation).

    The train side knows extensions only through this surface: they prepare per step and may
    change the advantages, may bring their own micro-step forward (whose extra per-token tensors
    reach their loss terms through `MicroBatch.extras`), add loss terms, and report metrics."""

    def begin_step(
        self, module: torch.nn.Module, batch: TrainBatch, advantages: torch.Tensor
    ) -> torch.Tensor:
        """Per-step work before the updates (no grad); returns the advantages `[B, R]` to train on."""
        ...

    def forward(
        self, module: torch.nn.Module, batch: TrainBatch, rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]] | None:
        """Its own micro-step forward (log-probs, entropy, extras), or None for the default."""
        ...

    def terms(self, aggregate: Aggregation) -> Sequence[LossTerm]:
        """Loss terms it adds to every micro-batch (aggregated like the policy loss)."""
        ...

    def step_metrics(self, mask: torch.Tensor) -> dict[str, float]:
        """Metrics of the step (without the `train/` prefix)."""
        ...


class TrainSide(ForwardPassesMixin, TrainStateMixin):
    """Owns the trained model; turns train batches into optimizer steps."""

    def __init__(
        self,
        cfg: TrainConfig,
        algorithm: AlgorithmConfig,
        *,
        model_path: str,
        total_steps: int,
        max_response_len: int,
        temperature: float,
        env: Mapping[str, str],
        opd: OpdConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.dist = DistInfo.from_env(env)
        self.temperature = temperature if temperature > 0 else 1.0
        self.max_response_len = max_response_len
        self.model_path = model_path
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(cfg.seed)
        self.algo = build_algorithm(algorithm)
        updates = total_steps * cfg.num_updates_per_rollout  # optimizer steps of the run (lr schedules)
        self.bundle = build_policy(cfg, model_path, total_steps=updates, dist_info=self.dist)
        self.ref: PolicyLogprobs | None = None
        """The separate frozen reference; never loaded with LoRA (the adapter is switched off instead)."""
        if self.algo.needs_reference and cfg.lora is None:
            self.ref = build_reference(cfg, cfg.ref_model_path or model_path, self.dist)
        self.lora = LoraState(self.bundle, cfg.lora) if cfg.lora is not None else None
        """Adapter-only sync, checkpoints and the adapter-disabled reference (`[train.lora]`)."""
        self.optimizer_steps = 0
        self._detail: StepDetailCollector | None = None
        """The last step's per-sample values, for the run's trajectory recording."""
        attn = resolve_attn_implementation(cfg.attn_implementation, cuda=torch.cuda.is_available())
        layout = cfg.effective_layout
        self.packing = layout == "packed" or (layout == "auto" and attn == "flash_attention_2")
        """Packed rather than right-padded, for forwards that take no layout choice (distillation)."""
        self.critic = self._critic(algorithm, updates)
        """The value model of PPO with GAE (`[algorithm.critic]`), its optimizer and schedule."""
        self._set_up_layouts(attn)
        self.opd: OpdTrainer | None = self._opd_trainer(opd) if opd is not None and opd.enabled else None
        """On-policy distillation (`[opd]`), when enabled: a step extension."""
        self.extensions: list[StepExtension] = [self.opd] if self.opd is not None else []
        """What joins every step besides the algorithm."""
        self.extra_terms: list[LossTerm] = [
            t for ext in self.extensions for t in ext.terms(self.algo.aggregate)
        ]
        """The extensions' loss terms, added to the algorithm's (and MoE's aux loss)."""
        self.moe = self._moe_runtime()
        """MoE models: routing replay, routing metrics and the load-balancing loss (`[train.moe]`)."""
        self.exact_tally = MismatchTally() if cfg.exact_on_policy else None
        """`train.exact_on_policy`: rollout/mismatch_tokens and rollout/mismatch_max per step."""

    def _critic(self, algorithm: AlgorithmConfig, updates: int) -> Critic | None:
        """PPO's value model (`[algorithm.critic]`; None without one), sharded and prepared like the policy."""
        if algorithm.critic is None:
            return None
        return Critic(
            algorithm.critic,
            self.cfg,
            self.model_path,
            total_steps=updates,
            dist=self.dist,
            accelerator=self.bundle.accelerator,
            packing=self.packing,
        )

    def _moe_runtime(self) -> MoeRuntime | None:
        """An MoE model's runtime (its aux-loss term added to `extra_terms`); None for a dense
        model, where routing replay or the aux loss is refused."""
        moe_cfg = self.cfg.moe
        moe = MoeRuntime.maybe(
            moe_cfg, self.bundle.hf_model, self.ref.policy if self.ref is not None else None
        )
        if moe is not None:
            self.extra_terms.append(MoeAuxTerm(moe_cfg.aux_loss_coef))
        elif moe_cfg.routing_replay != "off" or moe_cfg.aux_loss_coef:
            key = "train.moe.routing_replay" if moe_cfg.routing_replay != "off" else "train.moe.aux_loss_coef"
            raise ConfigError([Problem(key, self._no_router_why(), self._no_router_fix())])
        return moe

    def _no_router_why(self) -> str:
        from verst.rollout.moe import RECORDABLE_MODEL_TYPES, moe_spec

        config = self.bundle.hf_model.config
        if moe_spec(config) is None:
            return f"{self.model_path!r} is a dense model (no MoE routers to replay or balance)"
        family = getattr(config.get_text_config(), "model_type", "?")
        return (
            f"{self.model_path!r} is a mixture-of-experts model of family {family!r}, whose router verst does "
            f"not record (the families it records: {', '.join(sorted(RECORDABLE_MODEL_TYPES))})"
        )

    def _no_router_fix(self) -> str:
        return (
            "set train.moe.routing_replay = 'off' and train.moe.aux_loss_coef = 0, or use a model of a "
            "recorded MoE family (docs/moe.md)"
        )

    def _opd_trainer(self, opd: OpdConfig) -> OpdTrainer:
        cfg = self.cfg
        return OpdTrainer(
            opd,
            temperature=self.temperature,
            chunk_size=cfg.logprob_chunk_size,
            packing=self.packing,
            micro_batch_size=cfg.micro_batch_size,
            teacher_loader=lambda path, dtype: build_reference(
                cfg.model_copy(update={"dtype": dtype}), path, self.dist
            ),
        )

    # ------------------------------------------------------------ the step

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Advantages, then `num_updates_per_rollout` optimizer steps over the batch; returns metrics."""
        rollout_lp = batch.rollout_logprobs if batch.has_rollout_logprobs else None
        if self.algo.needs_rollout_logprobs and rollout_lp is None:
            raise ValueError(
                "the algorithm needs rollout log-probs (tis / use_rollout_logprobs_as_old) but the "
                "engine returned none; request log-probs from the engine"
            )
        plan = self._plan(batch)  # prompt groups, mini- and micro-batches: once per step
        moe_metrics: dict[str, float] = {}
        if self.moe is not None:
            self.moe.begin_step(
                batch.tokens,
                batch.response_lengths,
                batch.routed_experts or [None] * batch.num_samples,
                measure_in="old" if self._runs_old_pass() else "current",
            )
            moe_metrics = self._moe_mismatch_without_replay(batch, plan)
        step = self._step_tensors(batch, plan, rollout_lp)
        mask = batch.loss_mask  # [B, R]
        self._detail = StepDetailCollector(step.advantages, mask, batch.response_lengths, batch.record_rows)
        policy_waits = self.critic is not None and self.critic.warming_up  # critic warm-up
        out = self._policy_updates(batch, plan, step, skip=policy_waits)
        if self.critic is not None:
            assert step.values is not None and step.returns is not None
            critic_metrics = self.critic.update(batch, plan.updates, step.values, step.returns, plan.keys)
            out.update({f"train/critic/{k}": v for k, v in critic_metrics.items()})
            out["train/critic/policy_updated"] = 0.0 if policy_waits else 1.0
        out["train/advantage_abs_mean"] = float(
            (step.advantages.abs() * mask).sum() / mask.sum().clamp(min=1)
        )
        for ext in self.extensions:
            out.update({f"train/{k}": v for k, v in ext.step_metrics(mask).items()})
        if self.moe is not None:
            out.update({f"train/{k}": v for k, v in {**self.moe.step_metrics(), **moe_metrics}.items()})
        out.update(batch.metrics)
        if self.exact_tally is not None:
            out.update(self.exact_tally.metrics())
        return out

    def _step_tensors(
        self, batch: TrainBatch, plan: StepPlan, rollout_lp: torch.Tensor | None
    ) -> _StepTensors:
        """The no-grad passes before the updates (old and reference log-probs, the critic's
        values) and the advantages (the extensions may change them)."""
        algo, cfg = self.algo, self.cfg
        r2 = self.moe is not None and self.moe.mode == "old_policy"
        precompute_old = algo.needs_old_logprobs and (
            cfg.num_updates_per_rollout > 1 or algo.needs_kl_in_reward or r2
        )
        if r2:  # the old pass records the old policy's experts before anything replays them
            old_r2 = self.compute_old_logprobs(batch, plan)
        ref_lp = self.compute_ref_logprobs(batch, plan)
        old_all = (old_r2 if r2 else self.compute_old_logprobs(batch, plan)) if precompute_old else None
        kl = None
        if algo.needs_kl_in_reward:
            kl = (old_all if old_all is not None else rollout_lp) - ref_lp  # [B, R]
        # the step's prompt groups: the critic splits by them too
        values = self.critic.values(batch, plan.keys) if self.critic is not None else None  # [B, R]
        advantages, returns = algo.compute_advantages_and_returns(
            batch.rewards, batch.loss_mask, kl=kl, values=values, turn_rewards=batch.turn_rewards
        )
        for ext in self.extensions:
            advantages = ext.begin_step(self.bundle.module, batch, advantages)
        return _StepTensors(advantages, old_all, ref_lp, rollout_lp, values, returns)

    def _runs_old_pass(self) -> bool:
        """Whether the step runs the old-log-prob pass before its updates (`_step_tensors`)."""
        algo, r2 = self.algo, self.moe is not None and self.moe.mode == "old_policy"
        return r2 or (
            algo.needs_old_logprobs and (self.cfg.num_updates_per_rollout > 1 or algo.needs_kl_in_reward)
        )

    def _policy_updates(
        self, batch: TrainBatch, plan: StepPlan, step: _StepTensors, *, skip: bool
    ) -> dict[str, float]:
        """The policy's optimizer updates of the step (none with `skip`: the critic warms up);
        returns the loss metrics (averaged over the updates), the lr and the gradient norm."""
        mask = batch.loss_mask
        self.bundle.module.train()
        sums = MetricSums(_SUMMED)
        step_metrics: list[dict[str, float]] = []
        planned = [] if skip else list(zip(plan.updates, plan.update_micro_batches, strict=True))
        for u, (rows, mbs) in enumerate(planned):
            norm = LossNorm.from_masks([mask[rows]], self.max_response_len)
            for mb in mbs:
                at_old = step.old is not None or u == 0
                self._micro_step(batch, mb, norm, step, sums, at_old_weights=at_old, plan=plan)
            step_metrics.append(self._optimizer_step())
        metrics = sums.reduce(self.dist)
        n_updates = max(1, sum(1 for rows in plan.updates if rows))
        for k in _SUMMED & metrics.keys():  # each update's loss, averaged over the updates
            metrics[k] /= n_updates
        out = {f"train/{k}": v for k, v in metrics.items()}
        if step_metrics:
            out["train/lr"] = step_metrics[-1]["lr"]  # the last update's
            out["train/grad_norm"] = sum(m["grad_norm"] for m in step_metrics) / len(step_metrics)
        return out

    def step_detail(self) -> StepRowDetail | None:
        """Per-sample values of the last train step (`verst.trainer.train.step_detail`); None before one."""
        return None if self._detail is None else self._detail.detail

    def _forward_for_loss(
        self, batch: TrainBatch, mb: MicroBatch, plan: StepPlan | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """The micro-step forward: an extension's own (e.g. top-k OPD), else the default."""
        module = self.bundle.module
        for ext in self.extensions if mb.rows else ():
            if self.moe is not None:
                self.moe.hooks.replay = None  # an extension's own forward routes freely
            own = ext.forward(module, batch, list(mb.rows))
            if own is not None:
                return own
        lp, ent = self._forward(module, batch, mb, entropy=True, plan=plan)
        aux = self.moe.aux_loss if self.moe is not None and mb.rows else None
        return lp, ent, ({"moe_aux_loss": aux} if aux is not None else {})

    def _micro_step(
        self,
        batch: TrainBatch,
        mb: MicroBatch,
        norm: LossNorm,
        step: _StepTensors,
        sums: MetricSums,
        *,
        at_old_weights: bool = True,
        plan: StepPlan | None = None,
    ) -> None:
        """One micro-batch's forward, loss and backward; metrics accumulate into `sums`.

        `at_old_weights`: the old log-probs of these rows are known (precomputed, or this is the
        step's first update, before any optimizer step) — only then is `logprob_mismatch`
        (|old − rollout|) measured.
        """
        rows = list(mb.rows)
        lp, ent, extras = self._forward_for_loss(batch, mb, plan)
        if not rows:
            loss = (lp.sum() + (ent.sum() if ent is not None else 0.0)) * 0.0
            backward(loss, self.bundle.accelerator)
            return
        device = lp.device

        def rows_of(t: torch.Tensor | None) -> torch.Tensor | None:
            return t[rows].to(device) if t is not None else None

        m = batch.loss_mask[rows].to(device)
        rl = rows_of(step.rollout)
        old = rows_of(step.old) if step.old is not None else lp.detach()
        terms, pre = self.algo.micro_batch(
            lp,
            old if self.algo.needs_old_logprobs else None,
            rows_of(step.advantages),  # type: ignore[arg-type]
            m,
            rollout_logprobs=rl,
            ref_logprobs=rows_of(step.ref),
            entropy=ent,
            norm=norm,
            extras=extras,
        )
        out = self.algo.loss_of(terms, pre)
        extra_loss, extra_metrics = compose(self.extra_terms, terms)
        loss = out.loss if extra_loss is None else out.loss + extra_loss
        metrics = {**out.metrics, **to_floats(extra_metrics)}
        backward(loss * self.dist.world_size, self.bundle.accelerator)
        ntok = float(m.sum())
        if at_old_weights and self._detail is not None:
            self._detail.add_logprobs(rows, old)
        metrics.pop("logprob_mismatch", None)  # measured here, against the step's old weights
        if rl is not None and at_old_weights:  # the trainer's log-probs before this step's updates
            metrics.update(self._mismatch_metrics(old, rl, m, ntok))
        sums.add(metrics, ntok)

    def _mismatch_metrics(
        self, old: torch.Tensor, rl: torch.Tensor, m: torch.Tensor, ntok: float
    ) -> dict[str, float]:
        """Trainer (before the step's updates) against rollout log-probs over a micro-batch's tokens."""
        diff = (old.detach() - rl).abs() * m
        if self.exact_tally is not None:  # train.exact_on_policy: tokens that differ at all
            self.exact_tally.add(old, rl, m)
        return {
            "logprob_mismatch": float(diff.sum()) / max(ntok, 1.0),
            "logprob_mismatch_max": float(diff.max()) if ntok else 0.0,
            "logprob_ratio_clip_frac": float((outside_clip(old.detach() - rl) * m).sum()) / max(ntok, 1.0),
        }

    def _optimizer_step(self) -> dict[str, float]:
        lr = self.bundle.raw_optimizer().param_groups[0]["lr"]
        bundle = self.bundle
        grad_norm = optimizer_step(bundle.module, bundle.optimizer, bundle.scheduler, self.cfg.max_grad_norm)
        self.optimizer_steps += 1
        return {"grad_norm": grad_norm, "lr": lr}

    def close(self) -> None:
        """Release the models (the process group is the launcher's to destroy)."""
        self.bundle = None  # type: ignore[assignment]
        self.ref = None
        self.critic = None
