"""Mixture-of-experts training: routing replay (R3 / R2), the load-balancing loss, routing metrics.

`train.moe.routing_replay`:

- `"off"`: the trainer's routers choose for themselves (what a dense-model trainer does).
- `"rollout"` (R3): every forward — old, current and reference log-probs — uses the experts the
  engine recorded for each position (`Sample.routed_experts`); gate weights are recomputed from
  the current router logits over those experts, so the router still learns.
- `"old_policy"` (R2): the old-log-prob pass routes freely and its choices are recorded; the
  current-policy and reference forwards replay them.

**Getting the routing to the layout's positions.** A `RoutingTable` holds one row per position
of every sample of the step (`[positions, layers, k]`, -1 = free). To find the row of each
position of a laid-out micro-batch, the layout is built a second time on *row numbers* instead
of token ids: each sample's tokens replaced by the table rows of its positions (its prompt by
the rows of the first sample with the same prompt, so prompts that a layout shares stay equal),
padding by -1. The layout places these numbers exactly where it places the tokens, whatever
the layout (padded, packed, shared_prompt, or one added later), so `input_ids` of that build
*is* the gather index. `tests/trainer/test_moe_replay.py` checks this property.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field

from verst.rollout.config import Section
from verst.rollout.moe import RoutedExperts, RouterHooks
from verst.trainer.algorithms.terms import MicroBatch, TermOutput

ReplayMode = Literal["off", "rollout", "old_policy"]
REPLAY_MODES: tuple[str, ...] = ("off", "rollout", "old_policy")


class MoeSection(Section):
    """`[train.moe]`: routing replay, the load-balancing loss and routing metrics (MoE models)."""

    routing_replay: ReplayMode = Field(
        "off",
        description=(
            "Which experts the trainer's MoE layers use: 'off' = their own choice; 'rollout' (R3) = "
            "the ones the engine recorded per token (needs an engine that records routing); "
            "'old_policy' (R2) = the old policy's, recorded in the old-log-prob pass. Gate weights "
            "are recomputed from the current router logits over those experts (docs/moe.md)."
        ),
    )
    aux_loss_coef: float = Field(
        0.0, ge=0, description="Coefficient of the load-balancing auxiliary loss (0 = off)."
    )
    compare_without_replay: bool = Field(
        True,
        description=(
            "With replay on, also measure the log-prob mismatch to the engine without replay (one "
            "extra no-grad forward per step): metric moe/logprob_mismatch_no_replay."
        ),
    )


# ---------------------------------------------------------------- the table and the gather


def canonical_prompts(tokens: Sequence[Sequence[int]], response_lengths: Sequence[int]) -> list[int]:
    """Per sample, the first sample (in batch order) with the identical prompt."""
    first: dict[tuple[int, ...], int] = {}
    return [
        first.setdefault(tuple(seq[: len(seq) - r]), i)
        for i, (seq, r) in enumerate(zip(tokens, response_lengths, strict=True))
    ]


@dataclass
class RoutingTable:
    """Routing of every position of a step's samples: `ids [positions, layers, k]` (-1 = free)."""

    ids: torch.Tensor  # [positions, layers, k] long
    offsets: list[int]
    """Row of each sample's position 0."""
    canonical: list[int]
    """Per sample, the sample whose prompt rows stand for its prompt (`canonical_prompts`)."""
    recorded: list[bool] = field(default_factory=list)
    """Per sample, whether it came with recorded routing."""

    @classmethod
    def empty(
        cls, tokens: Sequence[Sequence[int]], response_lengths: Sequence[int], layers: int, k: int
    ) -> RoutingTable:
        """A table of -1 (filled by a recording forward: R2)."""
        offsets, total = [], 0
        for seq in tokens:
            offsets.append(total)
            total += len(seq)
        ids = torch.full((total, layers, k), -1, dtype=torch.long)
        return cls(ids, offsets, canonical_prompts(tokens, response_lengths), [False] * len(tokens))

    @classmethod
    def from_samples(
        cls,
        tokens: Sequence[Sequence[int]],
        response_lengths: Sequence[int],
        routed: Sequence[RoutedExperts | None],
        layers: int,
        k: int,
    ) -> RoutingTable:
        """The engine's recorded routing (R3); samples without any stay -1 (free)."""
        table = cls.empty(tokens, response_lengths, layers, k)
        for i, (seq, rec) in enumerate(zip(tokens, routed, strict=True)):
            if rec is None:
                continue
            if rec.width != layers * k or rec.tokens != len(seq) - 1:
                raise ValueError(
                    f"sample {i}: recorded routing is {rec.tokens} positions × {rec.width} ids, expected "
                    f"{len(seq) - 1} × {layers * k} (layers × experts per token of the trained model); "
                    "was it generated by another model?"
                )
            start = table.offsets[i]
            rows = rec.to_tensor().reshape(rec.tokens, layers, k)
            table.ids[start : start + rec.tokens] = rows
            table.recorded[i] = True
            prompt = min(len(seq) - response_lengths[i], rec.tokens)
            base = table.offsets[table.canonical[i]]
            if base != start:  # the group's prompt rows: fill what the canonical sample lacks
                shared = table.ids[base : base + prompt]
                missing = shared < 0
                shared[missing] = rows[:prompt][missing]
        return table

    def encoded(
        self, tokens: Sequence[Sequence[int]], response_lengths: Sequence[int], rows: Sequence[int]
    ) -> list[list[int]]:
        """`rows`' sequences with each token replaced by its table row (prompts by the canonical
        sample's rows, see the module doc)."""
        out = []
        for i in rows:
            n, r = len(tokens[i]), response_lengths[i]
            p = n - r
            base, own = self.offsets[self.canonical[i]], self.offsets[i]
            out.append([*range(base, base + p), *range(own + p, own + n)])
        return out

    def index_for(
        self,
        layout: Any,
        tokens: Sequence[Sequence[int]],
        response_lengths: Sequence[int],
        rows: Sequence[int],
        groups: Any = None,
    ) -> torch.Tensor:
        """The table row of every flattened position of `layout.build(rows' sequences)`
        (`[rows * width]`, -1 = padding)."""
        enc = self.encoded(tokens, response_lengths, rows)
        built = layout.build(enc, [response_lengths[i] for i in rows], pad_id=-1, groups=groups)
        return built.input_ids.reshape(-1)

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """Routing `[len(index), layers, k]` of those rows (-1 at padding and unrecorded rows)."""
        out = self.ids[index.clamp(min=0)]
        out[index < 0] = -1
        return out

    def scatter(self, index: torch.Tensor, chosen: torch.Tensor) -> None:
        """Record `chosen [len(index), layers, k]` at those rows (R2's recording forward)."""
        real = index >= 0
        self.ids[index[real]] = chosen[real.to(chosen.device)].to(self.ids.device, torch.long)


# ---------------------------------------------------------------- metrics and the aux loss


def routing_agreement(
    free: torch.Tensor, recorded: torch.Tensor, layers: Sequence[int]
) -> tuple[float, float]:
    """(equal token-layer choices, token-layer pairs compared): the top-k *sets* of `free` and
    `recorded` (`[N, layers, k]`) at positions and router layers that `recorded` covers."""
    rec = recorded[:, list(layers)]
    ok = (rec >= 0).all(-1)  # [N, router layers]
    same = (free[:, list(layers)].sort(-1).values == rec.to(free.device).sort(-1).values).all(-1)
    ok = ok.to(same.device)
    return float((same & ok).sum()), float(ok.sum())


def expert_counts(
    chosen: torch.Tensor, real: torch.Tensor, num_experts: int, layers: Sequence[int]
) -> torch.Tensor:
    """Assignments per (router layer, expert) `[len(layers), experts]` over the real positions."""
    out = torch.zeros((len(layers), num_experts), dtype=torch.float64)
    sel = chosen[real.to(chosen.device)]  # [n, layers, k]
    for j, layer in enumerate(layers):
        ids = sel[:, layer].reshape(-1)
        ids = ids[ids >= 0]
        out[j] = torch.bincount(ids.cpu(), minlength=num_experts)[:num_experts].double()
    return out


def load_balancing_loss(
    logits: dict[int, torch.Tensor], chosen: torch.Tensor, real: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Switch-style `E · Σ_e f_e · P_e` averaged over router layers, over the real positions:
    `f_e` the fraction of assignments to expert e (the experts used, replayed or not), `P_e` the
    mean router probability of e (differentiable). As transformers' `load_balancing_loss_func`."""
    terms = []
    for layer, lg in sorted(logits.items()):
        mask = real.to(lg.device)
        probs = torch.softmax(lg[mask].float(), dim=-1)  # [n, E]
        ids = chosen[mask.to(chosen.device), layer].to(lg.device)  # [n, k]
        frac = torch.zeros(num_experts, device=lg.device).index_add_(
            0, ids.reshape(-1), torch.ones(ids.numel(), device=lg.device)
        ) / max(ids.numel(), 1)
        terms.append(num_experts * (frac.detach() * probs.mean(0)).sum())
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).mean()


@dataclass(frozen=True, slots=True)
class MoeAuxTerm:
    """`aux_loss_coef · aux`: the load-balancing loss of the micro-batch's forward (its extra
    `moe_aux_loss`, a 0-d tensor), weighted by its share of the step's loss tokens so the step
    sums to the token-mean."""

    coef: float

    def __call__(self, mb: MicroBatch) -> TermOutput:
        aux = mb.extras.get("moe_aux_loss")
        if aux is None:
            return TermOutput(None)
        metrics = {"moe_aux_loss": aux.detach()}
        if self.coef == 0:
            return TermOutput(None, metrics)
        share = mb.mask.sum() / max(mb.norm.num_tokens, 1.0)
        return TermOutput(self.coef * aux * share.to(aux.dtype), metrics)


def _model_config(model_path: str | None, config_dir: Any = None) -> dict[str, Any] | None:
    """A local checkpoint's `config.json` (its `text_config` for a VLM), read as JSON; None when the
    path is not a local directory (a hub id: checked when the model loads)."""
    import json
    from pathlib import Path

    if model_path is None:
        return None
    for base in (Path.cwd(), Path(config_dir) if config_dir else None):
        if base is None:
            continue
        cfg = base / model_path / "config.json"
        if cfg.is_file():
            data = json.loads(cfg.read_text())
            return data.get("text_config", data)
    return None


def model_moe_spec(model_path: str | None, config_dir: Any = None) -> tuple[int, int, int] | str | None:
    """`moe_spec` of a local checkpoint's `config.json` (read as JSON, nothing imported); 'unknown'
    when the path is not a local directory (a hub id: checked when the model loads)."""
    from types import SimpleNamespace

    from verst.rollout.moe import moe_spec

    data = _model_config(model_path, config_dir)
    if data is None:
        return "unknown"
    return moe_spec(SimpleNamespace(**{"num_hidden_layers": 0, **data}))


def _unrecorded_family(model_path: str | None, config_dir: Any) -> str | None:
    """The `model_type` of a local MoE checkpoint whose routers verst cannot record, else None."""
    from verst.rollout.moe import RECORDABLE_MODEL_TYPES

    data = _model_config(model_path, config_dir) or {}
    model_type = data.get("model_type")
    return model_type if model_type and model_type not in RECORDABLE_MODEL_TYPES else None


def moe_problems(cfg: Any, model_path: str | None, config_dir: Any = None) -> list[Any]:
    """`[train.moe]` against the model and the engine: replay (or the aux loss) on a dense model,
    R3 with an engine that cannot return its experts."""
    from verst.rollout.errors import Problem

    moe, out = cfg.train.moe, []
    spec = (
        model_moe_spec(model_path, config_dir) if (moe.routing_replay != "off" or moe.aux_loss_coef) else None
    )
    if spec is None and moe.routing_replay != "off":
        out.append(
            Problem(
                "train.moe.routing_replay",
                f"routing replay {moe.routing_replay!r} needs a mixture-of-experts model, and {model_path!r} is "
                "dense (its config has no num_experts_per_tok / num_experts)",
                "set train.moe.routing_replay = 'off', or train an MoE model (docs/moe.md)",
            )
        )
    family = _unrecorded_family(model_path, config_dir) if isinstance(spec, tuple) else None
    if family is not None:
        from verst.rollout.moe import RECORDABLE_MODEL_TYPES

        key = "train.moe.routing_replay" if moe.routing_replay != "off" else "train.moe.aux_loss_coef"
        out.append(
            Problem(
                key,
                f"{model_path!r} is a mixture-of-experts model of family {family!r}, whose router verst does "
                f"not record (the families it records: {', '.join(sorted(RECORDABLE_MODEL_TYPES))})",
                "set train.moe.routing_replay = 'off' and train.moe.aux_loss_coef = 0 to train it without "
                "replay, or use a model of a recorded family (docs/moe.md)",
            )
        )
    if spec is None and moe.aux_loss_coef and moe.routing_replay == "off":
        out.append(
            Problem(
                "train.moe.aux_loss_coef",
                f"the load-balancing loss needs a mixture-of-experts model, and {model_path!r} is dense",
                "set train.moe.aux_loss_coef = 0",
            )
        )
    caps = cfg.engine.capabilities()
    wants = moe.routing_replay == "rollout" or cfg.rollout.return_routed_experts
    if wants and not caps.routing_replay:
        key = (
            "train.moe.routing_replay" if moe.routing_replay == "rollout" else "rollout.return_routed_experts"
        )
        out.append(
            Problem(
                key,
                f"engine type {cfg.engine.type!r} cannot return the experts it chose (its capabilities say "
                "routing_replay=False), so there is no recorded routing to replay",
                "use engine.type = 'embedded'; for SGLang servers launched with --enable-return-routed-experts "
                "(or verst serve) set engine.routed_experts = true; or use train.moe.routing_replay = "
                "'old_policy' (R2), which needs nothing from the engine",
            )
        )
    return out


def outside_clip(log_ratio: torch.Tensor, eps: float = 0.2) -> torch.Tensor:
    """1 where the trainer/engine ratio `exp(log_ratio)` leaves `[1 - eps, 1 + eps]` (the tokens a
    PPO clip of 0.2 would clip at the first update), else 0."""
    ratio = log_ratio.exp()
    return ((ratio < 1 - eps) | (ratio > 1 + eps)).to(log_ratio.dtype)


__all__ = [
    "REPLAY_MODES",
    "MoeAuxTerm",
    "MoeSection",
    "RouterHooks",
    "RoutingTable",
    "canonical_prompts",
    "expert_counts",
    "load_balancing_loss",
    "moe_problems",
    "outside_clip",
    "routing_agreement",
]
