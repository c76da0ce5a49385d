"""`TrainSide`: the policy, its reference, optimizer and scheduler, and one train step.

The controller talks to it only through `train_step`, `compute_old_logprobs`,
`state_dict_for_sync`, `save` / `load` and `close` — a surface narrow enough for a Ray actor
(or each torchrun rank) to implement. Every rank holds the whole (small) `TrainBatch`; rows are
dealt to ranks in even chunks and each rank runs the same number of micro-batches, so FSDP
collectives line up. The loss of each micro-batch is normalised by the step-global `LossNorm`
and multiplied by the world size (FSDP/DDP average gradients), so gradient accumulation over
micro-batches and ranks equals the full-batch gradient.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from verst.trainer.algorithms import AlgorithmConfig, LossNorm, build_algorithm
from verst.trainer.algorithms.aggregation import Aggregation
from verst.trainer.algorithms.terms import LossTerm, compose, to_floats
from verst.trainer.config import TrainConfig
from verst.trainer.opd.config import OpdConfig
from verst.trainer.opd.train import OpdTrainer
from verst.trainer.train.batch import TrainBatch
from verst.trainer.train.critic import Critic
from verst.trainer.train.fsdp import DistInfo, clip_grad_norm, collective_device, reduce_metrics
from verst.trainer.train.layout import LayoutChooser, PackedInputs
from verst.trainer.train.logprobs import PolicyLogprobs, pack_sequences, unflatten
from verst.trainer.train.lora import LoraState
from verst.trainer.train.model import build_policy, build_reference, resolve_attn_implementation
from verst.trainer.train.moe import MoeAuxTerm, outside_clip
from verst.trainer.train.moe_runtime import MoeRuntime, Phase
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


@dataclass
class _MetricSums:
    """Micro-batch metrics accumulated over a step (token-weighted, summed, or max)."""

    sums: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    def add(self, metrics: Mapping[str, float], ntok: float) -> None:
        for k, v in metrics.items():
            if k in _SUMMED:
                self.sums[k] = self.sums.get(k, 0.0) + v
            elif k.endswith("_max"):
                self.sums[k] = max(self.sums.get(k, float("-inf")), v)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v * ntok
                self.weights[k] = self.weights.get(k, 0.0) + ntok


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


def _reshard(module: torch.nn.Module) -> None:
    """Reshard FSDP2 units after a forward without backward (the layout probe): the root unit
    keeps its parameters gathered after a forward, and loading a checkpoint into gathered
    (plain-tensor) parameters fails."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class TrainSide(TrainStateMixin):
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
        self.bundle = build_policy(
            cfg, model_path, total_steps=total_steps * cfg.num_updates_per_rollout, dist_info=self.dist
        )
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
        self.critic = (
            Critic(
                algorithm.critic,
                cfg,
                model_path,
                total_steps=total_steps * cfg.num_updates_per_rollout,
                dist=self.dist,
                accelerator=self.bundle.accelerator,
                packing=self.packing,
            )
            if algorithm.critic is not None
            else None
        )
        """The value model of PPO with GAE (`[algorithm.critic]`), its optimizer and schedule."""
        self.layout = self._chooser(self.bundle.module, self.bundle.hf_model.config, attn)
        """Lays out the policy's micro-batches (`train.layout`; per micro-batch with 'auto')."""
        self.ref_layout = (
            self._chooser(self.ref, self.ref.policy.config, attn) if self.ref is not None else self.layout
        )
        """The same for the separate reference (its own model may share prompts or not)."""
        self.vision: Any = None
        """The `MultimodalProcessor` of a vision-language model, built by the first batch with images."""
        self.layout_counts: Counter[str] = Counter()
        """Micro-batches run in each layout so far (all forwards)."""
        self.opd: OpdTrainer | None = self._opd_trainer(opd) if opd is not None and opd.enabled else None
        """On-policy distillation (`[opd]`), when enabled: a step extension."""
        self.extensions: list[StepExtension] = [self.opd] if self.opd is not None else []
        """What joins every step besides the algorithm."""
        self.extra_terms: list[LossTerm] = [
            t for ext in self.extensions for t in ext.terms(self.algo.aggregate)
        ]
        """The extensions' loss terms, added to the algorithm's."""
        self.moe = MoeRuntime.maybe(
            cfg.moe, self.bundle.hf_model, self.ref.policy if self.ref is not None else None
        )
        """MoE models: routing replay, routing metrics and the load-balancing loss (`[train.moe]`)."""
        if self.moe is not None:
            self.extra_terms.append(MoeAuxTerm(cfg.moe.aux_loss_coef))
        elif cfg.moe.routing_replay != "off" or cfg.moe.aux_loss_coef:
            from verst.rollout.errors import ConfigError, Problem

            raise ConfigError(
                [
                    Problem(
                        "train.moe.routing_replay"
                        if cfg.moe.routing_replay != "off"
                        else "train.moe.aux_loss_coef",
                        f"{model_path!r} is a dense model (no MoE routers to replay or balance)",
                        "set train.moe.routing_replay = 'off' and train.moe.aux_loss_coef = 0, or train an MoE model",
                    )
                ]
            )

    def _chooser(self, module: torch.nn.Module, config: Any, attn: str) -> LayoutChooser:
        """`train.layout` for `module`; whether it may share prompts is probed on it (in eval mode,
        the same tiny forward on every rank; FSDP units resharded after)."""

        def probe(inputs: PackedInputs) -> torch.Tensor:
            with torch.no_grad():
                return module(inputs)[0].float().cpu()

        was_training = module.training
        module.eval()
        try:
            return LayoutChooser.build(
                self.cfg.effective_layout,
                config=config,
                attn=attn,
                probe=probe,
                tolerance=1e-3 if self.cfg.dtype == "float32" else 5e-2,
            )
        finally:
            module.train(was_training)
            _reshard(module)

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

    # ------------------------------------------------------------ log-probs

    def _plan(self, batch: TrainBatch) -> StepPlan:
        """The step's split of `batch` (prompt groups, mini-batches, micro-batches), made once."""
        return StepPlan.build(
            batch,
            micro_batch_size=self.cfg.micro_batch_size,
            num_updates=self.cfg.num_updates_per_rollout,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
        )

    def _forward(
        self,
        module: torch.nn.Module,
        batch: TrainBatch,
        rows: Sequence[int] | MicroBatch,
        *,
        entropy: bool,
        plan: StepPlan | None = None,
        phase: Phase = "current",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) `[len(rows), R]` of `rows`; a 1-token dummy for empty rows.

        `rows` is a planned `MicroBatch` (its layout comes from `plan`, picked once per step) or
        plain sample indices (laid out here). An empty micro-batch still runs a forward (FSDP
        collectives must line up across ranks); the caller multiplies its loss by 0.
        """
        width = batch.max_response_len
        if not (rows.rows if isinstance(rows, MicroBatch) else rows):
            seq = batch.tokens[0][:2]
            inputs = pack_sequences([seq], [1], packing=True)
            with self._moe(None, [], phase, module):
                lp, ent = module(inputs, temperature=self.temperature, return_entropy=entropy)
            return lp[None, :1], (ent[None, :1] if ent is not None else None)
        chooser = self.ref_layout if module is self.ref else self.layout
        idx = list(rows.rows) if isinstance(rows, MicroBatch) else list(rows)
        groups = rows.groups if isinstance(rows, MicroBatch) else None
        tokens, resp = [batch.tokens[i] for i in idx], [batch.response_lengths[i] for i in idx]
        planned = isinstance(rows, MicroBatch) and plan is not None
        if batch.images is not None:  # vision-language: the same layouts, through the bank (docs/vlm.md)
            from verst.trainer.train.vision import lay_out_batch, processor_for

            layout = plan.layout(chooser, batch, rows) if planned else chooser.pick(tokens, resp)
            self.vision = self.vision or processor_for(self.model_path)
            inputs = lay_out_batch(layout, self.vision, tokens, resp, [batch.images[i] for i in idx])
        else:
            layout = (
                plan.layout(chooser, batch, rows) if planned else chooser.pick(tokens, resp, groups=groups)
            )
            inputs = layout.build(tokens, resp, groups=groups)
        self.layout_counts[inputs.layout] += 1
        with self._moe(layout, idx, phase, module, groups):
            lp, ent = module(inputs, temperature=self.temperature, return_entropy=entropy)
        lp = unflatten(lp, inputs.response_lengths, width)
        return lp, (unflatten(ent, inputs.response_lengths, width) if ent is not None else None)

    def _moe(
        self, layout: Any, rows: list[int], phase: Phase, module: torch.nn.Module, groups: Any = None
    ) -> Any:
        """The MoE runtime around one forward (a no-op context for a dense model)."""
        if self.moe is None:
            return contextlib.nullcontext()
        rows = rows if layout is not None else []
        return self.moe.around(layout, rows, phase, reference=module is self.ref, groups=groups)

    @torch.no_grad()
    def _all_logprobs(
        self, module: torch.nn.Module, batch: TrainBatch, plan: StepPlan | None = None, phase: Phase = "old"
    ) -> torch.Tensor:
        """Log-probs `[B, R]` of every sample (no grad), gathered from all ranks."""
        plan = plan or self._plan(batch)
        out = torch.zeros(batch.loss_mask.shape)
        for mb in plan.all_micro_batches:
            lp, _ = self._forward(module, batch, mb, entropy=False, plan=plan, phase=phase)
            if mb.rows:
                out[list(mb.rows)] = lp.float().cpu()
        if self.dist.distributed:
            import torch.distributed as dist

            reduced = out.to(collective_device())
            dist.all_reduce(reduced)  # each row is filled on exactly one rank
            out = reduced.cpu()
        return out

    def compute_old_logprobs(self, batch: TrainBatch, plan: StepPlan | None = None) -> torch.Tensor:
        """The current policy's log-probs `[B, R]` of the batch (before any update)."""
        was_training = self.bundle.module.training
        self.bundle.module.eval()
        try:
            old = self._all_logprobs(self.bundle.module, batch, plan, "old")
            if self.moe is not None:
                self.moe.end_old_pass()
            return old
        finally:
            self.bundle.module.train(was_training)

    def _moe_mismatch_without_replay(self, batch: TrainBatch, plan: StepPlan) -> dict[str, float]:
        """With replay on: |log-prob − engine log-prob| of the trainer's own routing (a no-grad
        pass at the step's starting weights; `train.moe.compare_without_replay`)."""
        if self.moe is None or self.moe.mode == "off" or not self.cfg.moe.compare_without_replay:
            return {}
        if not batch.has_rollout_logprobs:
            return {}
        module = self.bundle.module
        was_training = module.training
        module.eval()
        try:
            free = self._all_logprobs(module, batch, plan, "free")
        finally:
            module.train(was_training)
        mask = batch.loss_mask
        diff = (free - batch.rollout_logprobs).abs() * mask
        return {
            "moe/logprob_mismatch_no_replay": float(diff.sum() / mask.sum().clamp(min=1)),
            "moe/logprob_ratio_clip_frac_no_replay": float(
                (outside_clip(free - batch.rollout_logprobs) * mask).sum() / mask.sum().clamp(min=1)
            ),
        }

    def compute_ref_logprobs(self, batch: TrainBatch, plan: StepPlan | None = None) -> torch.Tensor | None:
        """The frozen reference's log-probs `[B, R]`, or None when no reference is needed.

        With LoRA the reference is the policy with its adapter disabled (the frozen base)."""
        if self.lora is not None and self.algo.needs_reference:
            module = self.bundle.module
            was_training = module.training
            module.eval()
            try:
                with self.lora.adapter_disabled():
                    return self._all_logprobs(module, batch, plan, "ref")
            finally:
                module.train(was_training)
        return None if self.ref is None else self._all_logprobs(self.ref, batch, plan, "ref")

    # ------------------------------------------------------------ the step

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Advantages, then `num_updates_per_rollout` optimizer steps over the batch; returns metrics."""
        algo, cfg = self.algo, self.cfg
        mask = batch.loss_mask  # [B, R]
        rollout_lp = batch.rollout_logprobs if batch.has_rollout_logprobs else None
        if algo.needs_rollout_logprobs and rollout_lp is None:
            raise ValueError(
                "the algorithm needs rollout log-probs (tis / use_rollout_logprobs_as_old) but the "
                "engine returned none; request log-probs from the engine"
            )
        plan = self._plan(batch)  # prompt groups, mini- and micro-batches: once per step
        moe_metrics: dict[str, float] = {}
        r2 = self.moe is not None and self.moe.mode == "old_policy"
        precompute_old = algo.needs_old_logprobs and (
            cfg.num_updates_per_rollout > 1 or algo.needs_kl_in_reward or r2
        )
        if self.moe is not None:
            self.moe.begin_step(
                batch.tokens,
                batch.response_lengths,
                batch.routed_experts or [None] * batch.num_samples,
                measure_in="old" if r2 or precompute_old else "current",
            )
            moe_metrics = self._moe_mismatch_without_replay(batch, plan)
        if r2:  # the old pass records the old policy's experts before anything replays them
            old_r2 = self.compute_old_logprobs(batch, plan)
        ref_lp = self.compute_ref_logprobs(batch, plan)
        old_all = (old_r2 if r2 else self.compute_old_logprobs(batch, plan)) if precompute_old else None
        kl = None
        if algo.needs_kl_in_reward:
            kl = (old_all if old_all is not None else rollout_lp) - ref_lp  # [B, R]
        keys = plan.keys  # the step's prompt groups (the critic splits by them too)
        values = self.critic.values(batch, keys) if self.critic is not None else None  # [B, R]
        advantages, returns = algo.compute_advantages_and_returns(batch.rewards, mask, kl=kl, values=values)
        for ext in self.extensions:
            advantages = ext.begin_step(self.bundle.module, batch, advantages)
        step = _StepTensors(advantages, old_all, ref_lp, rollout_lp)
        self._detail = StepDetailCollector(advantages, mask, batch.response_lengths, batch.record_rows)

        self.bundle.module.train()
        sums = _MetricSums()
        step_metrics: list[dict[str, float]] = []
        updates = plan.updates
        policy_waits = self.critic is not None and self.critic.warming_up  # critic warm-up
        planned = [] if policy_waits else list(zip(updates, plan.update_micro_batches, strict=True))
        for u, (rows, mbs) in enumerate(planned):
            norm = LossNorm.from_masks([mask[rows]], self.max_response_len)
            for mb in mbs:
                self._micro_step(
                    batch, mb, norm, step, sums, at_old_weights=old_all is not None or u == 0, plan=plan
                )
            step_metrics.append(self._optimizer_step())
        metrics = reduce_metrics(sums.sums, sums.weights, _SUMMED, self.dist)
        n_updates = max(1, sum(1 for rows in updates if rows))
        for k in _SUMMED & metrics.keys():  # each update's loss, averaged over the updates
            metrics[k] /= n_updates
        out = {f"train/{k}": v for k, v in metrics.items()}
        if step_metrics:
            out["train/lr"] = step_metrics[-1]["lr"]  # the last update's
            out["train/grad_norm"] = sum(m["grad_norm"] for m in step_metrics) / len(step_metrics)
        if self.critic is not None:
            assert values is not None and returns is not None
            critic_metrics = self.critic.update(batch, updates, values, returns, keys)
            out.update({f"train/critic/{k}": v for k, v in critic_metrics.items()})
            out["train/critic/policy_updated"] = 0.0 if policy_waits else 1.0
        out["train/advantage_abs_mean"] = float((advantages.abs() * mask).sum() / mask.sum().clamp(min=1))
        for ext in self.extensions:
            out.update({f"train/{k}": v for k, v in ext.step_metrics(mask).items()})
        if self.moe is not None:
            out.update({f"train/{k}": v for k, v in {**self.moe.step_metrics(), **moe_metrics}.items()})
        out.update(batch.metrics)
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
        sums: _MetricSums,
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
            self._backward(loss)
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
        self._backward(loss * self.dist.world_size)
        ntok = float(m.sum())
        if at_old_weights and self._detail is not None:
            self._detail.add_logprobs(rows, old)
        metrics.pop("logprob_mismatch", None)  # measured here, against the step's old weights
        if rl is not None and at_old_weights:  # the trainer's log-probs before this step's updates
            diff = (old.detach() - rl).abs() * m
            metrics["logprob_mismatch"] = float(diff.sum()) / max(ntok, 1.0)
            metrics["logprob_mismatch_max"] = float(diff.max()) if ntok else 0.0
            metrics["logprob_ratio_clip_frac"] = float((outside_clip(old.detach() - rl) * m).sum()) / max(
                ntok, 1.0
            )
        sums.add(metrics, ntok)

    def _backward(self, loss: torch.Tensor) -> None:
        acc = self.bundle.accelerator
        if acc is not None:
            acc.backward(loss)
        else:
            loss.backward()

    def _optimizer_step(self) -> dict[str, float]:
        params = [p for p in self.bundle.module.parameters() if p.requires_grad]
        grad_norm = clip_grad_norm(params, self.cfg.max_grad_norm)
        lr = self.bundle.raw_optimizer().param_groups[0]["lr"]
        self.bundle.optimizer.step()
        self.bundle.scheduler.step()
        self.bundle.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return {"grad_norm": grad_norm, "lr": lr}

    def close(self) -> None:
        """Release the models (the process group is the launcher's to destroy)."""
        self.bundle = None  # type: ignore[assignment]
        self.ref = None
        self.critic = None
