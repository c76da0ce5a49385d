"""`MoeRuntime`: what `TrainSide` does around each forward of an MoE model (`train.moe`).

Per step: `begin_step(batch)` builds the rollout routing table (the engine's recorded experts)
and, for R2, an empty old-policy table. Around every forward, `around(...)` finds the table row of
each laid-out position (`RoutingTable.index_for`), sets the replay for the routers (per mode and
phase, see below), and after the forward records what it needs: R2's old choices, the routing
agreement with the engine and the expert load (the first forward over each sample, at the step's
starting weights), and the load-balancing loss (current-policy forwards, with its gradient).

| phase | off | rollout (R3) | old_policy (R2) |
|---|---|---|---|
| `old` (old log-probs) | free | rollout's | free, recorded |
| `current` (the loss) | free | rollout's | old's |
| `ref` (reference) | free | rollout's | old's |
| `free` (mismatch without replay) | free | free | free |
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch

from verst.rollout.moe import RouterHooks, find_routers, moe_spec
from verst.trainer.train.moe import (
    MoeSection,
    RoutingTable,
    expert_counts,
    load_balancing_loss,
    routing_agreement,
)

Phase = Literal["old", "current", "ref", "free"]


class MoeRuntime:
    """Routing replay, routing metrics and the aux loss for one trained MoE model."""

    def __init__(self, cfg: MoeSection, policy: Any, reference: Any | None = None) -> None:
        spec = moe_spec(policy.config)
        if spec is None or not find_routers(policy):
            raise ValueError("train.moe needs an MoE model; this one is dense")
        self.cfg = cfg
        self.layers, self.k, self.num_experts = spec
        self.hooks = RouterHooks(policy, keep_logits=cfg.aux_loss_coef > 0)
        same = reference is not None and moe_spec(reference.config) == spec and find_routers(reference)
        self.ref_hooks = RouterHooks(reference) if same else None
        """The separate reference's routers (None: no separate reference, or not the same MoE)."""
        self.rollout: RoutingTable | None = None
        self.old: RoutingTable | None = None
        self._tokens: Sequence[Sequence[int]] = ()
        self._lens: Sequence[int] = ()
        self._measured: set[int] = set()
        self._measure_in: Phase = "current"
        self._agree = [0.0, 0.0, 0.0]
        self._load = torch.zeros((len(self.hooks.router_layers), self.num_experts), dtype=torch.float64)
        self._response_rows = torch.zeros(0, dtype=torch.bool)
        """Per table row: a response token's own position (`begin_step`)."""
        self.aux_loss: torch.Tensor | None = None
        """The last current-policy forward's load-balancing loss (0-d, with grad)."""

    @property
    def mode(self) -> str:
        return self.cfg.routing_replay

    @classmethod
    def maybe(cls, cfg: MoeSection, policy: Any, reference: Any | None = None) -> MoeRuntime | None:
        """A runtime for an MoE `policy`; None for a dense one (validation refuses replay there)."""
        if moe_spec(policy.config) is None or not find_routers(policy):
            return None
        return cls(cfg, policy, reference)

    # ---------------------------------------------------------------- per step
    def begin_step(
        self,
        tokens: Sequence[Sequence[int]],
        lens: Sequence[int],
        routed: Sequence[Any],
        *,
        measure_in: Phase = "old",
    ) -> None:
        """A new step's samples (their tokens, response lengths and recorded routing).
        `measure_in`: the pass whose forwards measure agreement and load ('old' when the step
        runs one, else 'current'): each sample is in exactly one rank's micro-batches of a pass,
        so under FSDP every sample is counted once."""
        self._tokens, self._lens, self._measure_in = tokens, lens, measure_in
        self.rollout = RoutingTable.from_samples(tokens, lens, routed, self.layers, self.k)
        self.old = (
            RoutingTable.empty(tokens, lens, self.layers, self.k) if self.mode == "old_policy" else None
        )
        self._response_rows = torch.zeros(self.rollout.ids.shape[0], dtype=torch.bool)
        for start, seq, r in zip(self.rollout.offsets, tokens, lens, strict=True):
            self._response_rows[start + len(seq) - r : start + len(seq)] = True
        self._measured = set()
        self._agree = [0.0, 0.0, 0.0]
        self._load.zero_()

    def end_old_pass(self) -> None:
        """After the old pass on every rank: each rank filled its own rows of the R2 table."""
        if self.old is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            from verst.trainer.train.fsdp import collective_device

            ids = self.old.ids.to(collective_device())
            torch.distributed.all_reduce(ids, op=torch.distributed.ReduceOp.MAX)  # -1 where unfilled
            self.old.ids = ids.cpu()

    def _replay_table(self, phase: Phase) -> RoutingTable | None:
        if phase == "free" or self.mode == "off":
            return None
        if self.mode == "rollout":
            return self.rollout
        return None if phase == "old" else self.old

    # ---------------------------------------------------------------- per forward
    @contextmanager
    def around(
        self, layout: Any, rows: Sequence[int], phase: Phase, *, reference: bool = False, groups: Any = None
    ) -> Iterator[None]:
        """Replay (or not) for one forward of `rows` laid out by `layout`; records after it."""
        hooks = self.ref_hooks if reference else self.hooks
        if hooks is None or self.rollout is None or not rows:
            for h in (self.hooks, self.ref_hooks):
                if h is not None:
                    h.replay = None
            yield
            return
        index = self.positions(layout, rows, groups)  # [N]
        table = self._replay_table(phase)
        hooks.replay = None if table is None else table.gather(index)  # each router moves its layer
        hooks.clear()
        hooks.record = True
        yield
        real = index >= 0
        if phase == "old" and self.old is not None:
            self.old.scatter(index, hooks.chosen().cpu())
        fresh = [i for i in rows if i not in self._measured]
        if phase == self._measure_in and fresh and not reference:
            self._measure(hooks, index, real)
            self._measured.update(rows)
        if phase == "current" and not reference and hooks.keep_logits:
            self.aux_loss = load_balancing_loss(hooks.logits, hooks.chosen(), real, self.num_experts)
        hooks.clear()  # the replay stays set: a recomputing backward (checkpointing) sees it

    def positions(self, layout: Any, rows: Sequence[int], groups: Any = None) -> torch.Tensor:
        """The table row (R3's and R2's tables alike) of every flattened position of `layout`
        built on `rows` (`[rows * width]`, -1 = padding)."""
        assert self.rollout is not None, "begin_step first"
        return self.rollout.index_for(layout, self._tokens, self._lens, rows, groups)

    def _measure(self, hooks: RouterHooks, index: torch.Tensor, real: torch.Tensor) -> None:
        """Agreement over the response tokens' own positions (laid out exactly once, on one
        rank, in every layout: a group's shared prompt rows would count once or per sample
        depending on the micro-batch's layout); expert load over every real position."""
        assert self.rollout is not None
        own = real & self._response_rows[index.clamp(min=0)]
        recorded = self.rollout.gather(index[own])
        free, chosen = hooks.free_choice().cpu()[own], hooks.chosen().cpu()[own]
        agree, total = routing_agreement(free, recorded, hooks.router_layers)
        used, _ = routing_agreement(chosen, recorded, hooks.router_layers)
        self._agree[0] += agree
        self._agree[1] += total
        self._agree[2] += used
        self._load += expert_counts(hooks.chosen().cpu(), real, self.num_experts, hooks.router_layers)

    # ---------------------------------------------------------------- metrics
    def step_metrics(self) -> dict[str, float]:
        """`moe/*` metrics of the step (summed over ranks): `routing_agreement`, the fraction of
        recorded token-layer choices at response positions the trainer's routers make themselves
        (without replay);
        `replay_agreement`, the fraction they used (1.0 with R3); expert load per router layer
        (`expert_load_max_l<i>`: max / mean assignments, 1 = balanced); positions compared."""
        agree = torch.tensor(self._agree, dtype=torch.float64)
        load = self._load.clone()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            from verst.trainer.train.fsdp import collective_device

            both = torch.cat([agree, load.reshape(-1)]).to(collective_device())
            torch.distributed.all_reduce(both)
            agree, load = both[:3].cpu(), both[3:].cpu().reshape(load.shape)
        out: dict[str, float] = {}
        if agree[1] > 0:
            out["moe/routing_agreement"] = float(agree[0] / agree[1])
            out["moe/replay_agreement"] = float(agree[2] / agree[1])
            out["moe/routing_compared"] = float(agree[1])
        for j, layer in enumerate(self.hooks.router_layers):
            counts = load[j]
            if counts.sum() > 0:
                out[f"moe/expert_load_max_l{layer}"] = float(counts.max() / counts.mean())
        return out

    def close(self) -> None:
        self.hooks.close()
        if self.ref_hooks is not None:
            self.ref_hooks.close()
