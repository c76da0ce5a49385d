"""The train side's forwards: a micro-batch laid out and run through a model (`_forward`), and
the no-grad log-prob passes over the whole batch (old policy, reference, and MoE's mismatch
without replay). Mixed into `TrainSide`.

Every forward takes its micro-batch from the step's `StepPlan` (rows, prompt groups, and the
layout picked once per step and chooser), so the old, reference and training forwards of one
micro-batch agree on their layout without choosing again (`train.plan`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from verst.rollout.exact_ops import KEY_BLOCK
from verst.trainer.train.batch import TrainBatch
from verst.trainer.train.fsdp import sum_over_ranks
from verst.trainer.train.layout import PackedInputs
from verst.trainer.train.layout_choice import LayoutChooser
from verst.trainer.train.logprobs import PolicyLogprobs, pack_sequences, unflatten
from verst.trainer.train.moe import outside_clip
from verst.trainer.train.moe_runtime import MoeRuntime, Phase
from verst.trainer.train.optim import eval_mode
from verst.trainer.train.pieces import ATTENTION_NAME as PIECES_ATTENTION
from verst.trainer.train.pieces import use_pieces_attention
from verst.trainer.train.plan import MicroBatch, StepPlan


def _reshard(module: torch.nn.Module) -> None:
    """Reshard FSDP2 units after a forward without backward (the layout probe): the root unit
    keeps its parameters gathered after a forward, and loading a checkpoint into gathered
    (plain-tensor) parameters fails."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class ForwardPassesMixin:
    """Forwards and log-prob passes of `TrainSide` (its config, models, layouts and MoE runtime)."""

    cfg: Any
    dist: Any
    algo: Any
    bundle: Any
    lora: Any
    model_path: str
    temperature: float
    ref: PolicyLogprobs | None
    moe: MoeRuntime | None
    layout: LayoutChooser
    ref_layout: LayoutChooser
    vision: Any
    layout_counts: Counter[str]

    def _set_up_layouts(self, attn: str) -> None:
        """The layout choosers of the policy and the separate reference (probed on each model)."""
        self.layout = self._chooser(self.bundle.module, self.bundle.hf_model, attn)
        """Lays out the policy's micro-batches (`train.layout`; per micro-batch with 'auto')."""
        self.ref_layout = (
            self._chooser(self.ref, self.ref.policy, attn) if self.ref is not None else self.layout
        )
        """The same for the separate reference (its own model may share prompts or not)."""
        self.vision = None
        """The `MultimodalProcessor` of a vision-language model, built by the first batch with images."""
        self.layout_counts = Counter()
        """Micro-batches run in each layout so far (all forwards)."""

    def _chooser(self, module: torch.nn.Module, hf_model: Any, attn: str) -> LayoutChooser:
        """`train.layout` for `module` (wrapping `hf_model`); whether it may share prompts is probed
        on it (in eval mode, the same tiny forward on every rank; FSDP units resharded after). A
        text model on SDPA that may share prompts is switched to the pieces attention first
        (`verst.trainer.train.pieces`), so the probe checks that path too."""
        config = hf_model.config
        text_only = getattr(config, "vision_config", None) is None
        exact = self.cfg.exact_on_policy  # the model runs verst.rollout.exact_ops' attention
        # (its own per-sequence gather for packed and shared-prompt rows; no pieces, so no flat rows)
        if (
            self.cfg.effective_layout in ("auto", "shared_prompt")
            and attn == "sdpa"
            and text_only
            and not exact
        ):
            attn = PIECES_ATTENTION if use_pieces_attention(hf_model) else attn

        def probe(inputs: PackedInputs) -> torch.Tensor:
            with torch.no_grad():
                return module(inputs)[0].float().cpu()

        try:
            with eval_mode(module):
                return LayoutChooser.build(
                    self.cfg.effective_layout,
                    config=config,
                    attn=attn,
                    probe=probe,
                    # exact: packed and shared-prompt rows must give the padded rows' bits
                    tolerance=0.0 if exact else 1e-3 if self.cfg.dtype == "float32" else 5e-2,
                    max_width=KEY_BLOCK if exact else None,  # exact: rows of several sequences in one block
                )
        finally:
            _reshard(module)

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
            if batch.images is not None:  # the vision parameters join the graph as on other ranks
                from verst.trainer.train.vision import VisionBatch, processor_for

                self.vision = self.vision or processor_for(self.model_path)
                inputs.vision = VisionBatch.empty(self.vision)
            with self._moe(None, [], phase, module):
                lp, ent = module(inputs, temperature=self.temperature, return_entropy=entropy)
            return lp[None, :1], (ent[None, :1] if ent is not None else None)
        idx = list(rows.rows) if isinstance(rows, MicroBatch) else list(rows)
        groups = rows.groups if isinstance(rows, MicroBatch) else None
        layout, inputs = self._lay_out(module, batch, rows, plan)
        self.layout_counts[inputs.layout] += 1
        with self._moe(layout, idx, phase, module, groups):
            lp, ent = module(inputs, temperature=self.temperature, return_entropy=entropy)
        lp = unflatten(lp, inputs.response_lengths, width)
        return lp, (unflatten(ent, inputs.response_lengths, width) if ent is not None else None)

    def _lay_out(
        self,
        module: torch.nn.Module,
        batch: TrainBatch,
        rows: Sequence[int] | MicroBatch,
        plan: StepPlan | None,
    ) -> tuple[Any, PackedInputs]:
        """The layout of non-empty `rows` for `module` (the plan's, or picked here) and the inputs."""
        chooser = self.ref_layout if module is self.ref else self.layout
        idx = list(rows.rows) if isinstance(rows, MicroBatch) else list(rows)
        groups = rows.groups if isinstance(rows, MicroBatch) else None
        tokens, resp = [batch.tokens[i] for i in idx], [batch.response_lengths[i] for i in idx]
        planned = isinstance(rows, MicroBatch) and plan is not None
        if batch.images is not None:  # vision-language: the same layouts, through the bank (docs/vlm.md)
            from verst.trainer.train.vision import lay_out_batch, processor_for

            layout = plan.layout(chooser, batch, rows) if planned else chooser.pick(tokens, resp)
            self.vision = self.vision or processor_for(self.model_path)
            return layout, lay_out_batch(layout, self.vision, tokens, resp, [batch.images[i] for i in idx])
        layout = plan.layout(chooser, batch, rows) if planned else chooser.pick(tokens, resp, groups=groups)
        return layout, layout.build(tokens, resp, groups=groups)

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
        return sum_over_ranks(out, self.dist)  # each row is filled on exactly one rank

    def compute_old_logprobs(self, batch: TrainBatch, plan: StepPlan | None = None) -> torch.Tensor:
        """The current policy's log-probs `[B, R]` of the batch (before any update)."""
        with eval_mode(self.bundle.module) as module:
            old = self._all_logprobs(module, batch, plan, "old")
        if self.moe is not None:
            self.moe.end_old_pass()
        return old

    def compute_ref_logprobs(self, batch: TrainBatch, plan: StepPlan | None = None) -> torch.Tensor | None:
        """The frozen reference's log-probs `[B, R]`, or None when no reference is needed.

        With LoRA the reference is the policy with its adapter disabled (the frozen base)."""
        if self.lora is not None and self.algo.needs_reference:
            with eval_mode(self.bundle.module) as module, self.lora.adapter_disabled():
                return self._all_logprobs(module, batch, plan, "ref")
        return None if self.ref is None else self._all_logprobs(self.ref, batch, plan, "ref")

    def _moe_mismatch_without_replay(self, batch: TrainBatch, plan: StepPlan) -> dict[str, float]:
        """With replay on: |log-prob − engine log-prob| of the trainer's own routing (a no-grad
        pass at the step's starting weights; `train.moe.compare_without_replay`)."""
        if self.moe is None or self.moe.mode == "off" or not self.cfg.moe.compare_without_replay:
            return {}
        if not batch.has_rollout_logprobs:
            return {}
        with eval_mode(self.bundle.module) as module:
            free = self._all_logprobs(module, batch, plan, "free")
        mask = batch.loss_mask
        diff = (free - batch.rollout_logprobs).abs() * mask
        return {
            "moe/logprob_mismatch_no_replay": float(diff.sum() / mask.sum().clamp(min=1)),
            "moe/logprob_ratio_clip_frac_no_replay": float(
                (outside_clip(free - batch.rollout_logprobs) * mask).sum() / mask.sum().clamp(min=1)
            ),
        }
