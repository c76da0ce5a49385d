"""The speculative decode step: propose, verify `k + 1` positions in one forward, keep what passes.

`SpeculativeDecoder.step(batch)` is the hook `DecodeBatch.step` calls first. It asks the proposer
for up to `num_tokens` tokens per row (each row's own budget, and its own back-off below); when no
row has a proposal it returns False and the plain one-token step runs. Otherwise one forward
feeds every slot its last token and its proposals (padded to the step's longest; `model(...)`,
the causal mask inside the block from the cache columns), `verify.verify` decides per row, and
the batch moves on: each row's kept positions stay in the KV cache and its rejected ones are
masked out (the rollback; positions are explicit, so the holes never shift RoPE), `next_pos`
advances by what was kept, and the drawn token becomes the row's `last`. Masked holes are
squeezed out (`_repack`: every row's live columns right-aligned, one gather per layer) once they
make a quarter of the cache's width. Log-probs are the target's `log_softmax(logits / T)` at each
emitted token (never the draft's); MoE routing is recorded for the fed positions that were kept.

Back-off (per row, deterministic: a row's proposals depend on its own history only, so a seeded
request stays reproducible whatever shares its batch): a row whose proposals were all rejected
halves its proposal length, at 0 it pauses for `2^misses` steps (at most 16) and tries 1 token
again; a fully accepted proposal grows it back by one up to `num_tokens`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from verst.rollout.engines.embedded.sampling import ids_logprobs, top_logprobs
from verst.rollout.engines.embedded.speculative import ragged
from verst.rollout.engines.embedded.speculative.verify import Verdict, verify


@dataclass(slots=True)
class RowSpec:
    """One row's speculative state."""

    allowed: int
    """Proposal length it may use now."""
    pause: int = 0
    """Steps left before it proposes again."""
    misses: int = 0
    """Consecutive fully rejected proposals."""
    index: Any = None
    """The n-gram proposer's index of its context."""
    accept: float | None = None
    """EMA of the fraction of its proposed tokens accepted (`gate.CostGate`)."""
    probe_at: int | None = None
    """Seeded rows gated off: the output length at which the gate probes next (`gate.CostGate`)."""
    probe_gap: int = 0
    """... and the current gap between its probes."""


@dataclass(slots=True)
class SpeculativeStats:
    """Counters since the engine started (`EmbeddedEngine.speculative_stats`)."""

    steps: int = 0
    """Verification steps run."""
    plain_steps: int = 0
    """Steps that ran plain decoding (no row had a proposal)."""
    rows: int = 0
    """Row-steps that verified proposals."""
    proposed: int = 0
    """Tokens proposed."""
    accepted: int = 0
    """Proposed tokens accepted."""
    emitted: int = 0
    """Tokens emitted by verification steps (accepted + one drawn per row)."""
    gated: int = 0
    """Plain steps the cost gate chose although some row had proposals allowed."""
    fed: int = 0
    """Tokens verify forwards computed (ragged: each row's last token and its proposals; padded:
    every slot `k + 1`)."""

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": float(self.steps),
            "plain_steps": float(self.plain_steps),
            "rows": float(self.rows),
            "proposed": float(self.proposed),
            "accepted": float(self.accepted),
            "emitted": float(self.emitted),
            "gated": float(self.gated),
            "fed": float(self.fed),
        }


@dataclass(slots=True)
class SpeculativeDecoder:
    """A proposer plus the verification step (see the module doc)."""

    proposer: Any
    num_tokens: int
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)
    gate: Any = None
    """`gate.CostGate` (None: `gate = "off"`, speculate whenever a row has a proposal)."""
    ragged: bool = True
    """Verify forwards compute each row's own tokens only (`speculative/ragged.py`) where they can
    (off: every slot's `k + 1`, as `benchmarks/speculative.py --verify padded` compares)."""
    _t0: float | None = None
    REPACK_FRACTION = 0.25

    def plain_done(self, batch: Any) -> None:
        """`DecodeBatch.step` ran a plain step after `step` returned False: time it for the gate."""
        if self.gate is not None and self._t0 is not None:
            self.gate.observe(0, time.perf_counter() - self._t0, len(batch.rows))
        self._t0 = None

    def _caps(self, rows: list[Any]) -> list[int]:
        caps = []
        for r in rows:
            if r.spec is None:
                r.spec = RowSpec(self.num_tokens)
            room = r.limit - len(r.output_ids) - 1  # the drawn token needs one
            if r.spec.pause > 0:
                r.spec.pause -= 1
                caps.append(0)
            else:
                caps.append(max(0, min(r.spec.allowed, room)))
        return caps

    def step(self, batch: Any) -> bool:
        """One speculative step of `batch` (a `DecodeBatch`); False: nothing proposed, not stepped."""
        t0 = self._t0 = time.perf_counter()
        rows = batch.rows
        caps = self._caps(rows)
        if self.gate is not None and any(caps):
            caps = self.gate.choose(rows, caps)
            if not any(caps):
                self.stats.gated += 1
        if not any(caps):
            self.stats.plain_steps += 1
            return False
        proposals, q = self.proposer.propose(batch, rows, caps)
        k = max(len(p) for p in proposals)
        if k == 0:
            self.stats.plain_steps += 1
            return False
        self._t0 = None
        at = batch.slots if batch.slots is not None else list(range(len(rows)))
        n = batch.mask.shape[0]
        rows_props, cnt = [[0] * k for _ in range(n)], [0] * n  # slot order, padded with 0
        for p, j in zip(proposals, at, strict=True):
            rows_props[j][: len(p)], cnt[j] = p, len(p)
        props = torch.tensor(rows_props, dtype=torch.long, device=batch.device)  # [slots, k]
        counts = torch.tensor(cnt, dtype=torch.long, device=batch.device)
        q_slots = None
        if q is not None:  # [rows, k', vocab] → [slots, k, vocab]
            q_slots = q.new_zeros((n, k, q.shape[-1]))
            q_slots[torch.tensor(at, device=batch.device)] = q[:, :k]
        logits = self._forward(batch, props, counts, k)
        verdict = verify(logits, props, counts, q_slots, batch.sampling, batch.next_pos + 1)
        self._advance(batch, verdict, k)
        self._record(batch, rows, at, verdict, counts)
        if self.gate is not None:
            self.gate.observe(k, time.perf_counter() - t0, len(rows))
        return True

    def _forward(self, batch: Any, props: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
        """The target's logits at `k + 1` positions per slot: `[slots, k + 1, vocab]` (ragged where
        it can be, `speculative/ragged.py`: each slot computes its `1 + counts` tokens only)."""
        n = props.shape[0]
        ids = torch.cat([batch.last[:, None], props], 1)  # [slots, k + 1]
        mask = torch.cat([batch.mask, batch.mask.new_ones((n, k + 1))], 1)
        pos = batch.next_pos[:, None] + torch.arange(k + 1, device=batch.device)[None]
        for layer in batch.cache.layers:
            layer.spare = max(layer.spare, k + 1)
        packed = self.ragged and ragged.usable(batch)
        self.stats.fed += int(counts.sum()) + n if packed else n * (k + 1)
        if packed:
            batch.mask = mask
            return ragged.verify_logits(batch.direct, ids, counts + 1, mask, pos, batch.cache)
        batch._route(batch.slot_rows)
        out = batch.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=batch.cache, use_cache=True
        )
        batch.mask = mask
        return out.logits

    def _advance(self, batch: Any, v: Verdict, k: int) -> None:
        """Keep each slot's accepted positions (mask out the rest), move positions and `last` on."""
        kept = torch.arange(k + 1, device=batch.device)[None] <= v.accepted[:, None]  # [slots, k + 1]
        batch.mask[:, -(k + 1) :] = kept.to(batch.mask.dtype)
        batch.next_pos = batch.next_pos + v.accepted + 1
        batch.last = v.tokens.gather(1, v.accepted[:, None])[:, 0]
        if batch.routers is not None:  # [slots × (k + 1), layers × experts] → kept positions only
            routed = batch.routers.take_rows().view(batch.mask.shape[0], k + 1, -1)
            at = batch.slots if batch.slots is not None else range(len(batch.rows))
            acc = v.accepted.tolist()
            for r, j in zip(batch.rows, at, strict=True):
                r.routing.append(routed[j, : acc[j] + 1])
        width = batch.mask.shape[1]
        need = int(batch.mask.sum(1).max())
        if width - need >= max(8, self.REPACK_FRACTION * width):
            _repack(batch, need)

    def _record(self, batch: Any, rows: list[Any], at: list[int], v: Verdict, counts: torch.Tensor) -> None:
        """Append each row's emitted tokens (stopping at a finish) with the target's log-probs."""
        chosen = (v.scores.gather(-1, v.tokens[:, :, None]) - v.lse)[:, :, 0].tolist()  # [slots, k + 1]
        toks, acc, cnt = v.tokens.tolist(), v.accepted.tolist(), counts.tolist()
        s = self.stats
        s.steps += 1
        for r, j in zip(rows, at, strict=True):
            if cnt[j]:
                s.rows += 1
                s.proposed += cnt[j]
                s.accepted += acc[j]
                _back_off(r.spec, acc[j], cnt[j], self.num_tokens)
                if self.gate is not None:
                    self.gate.update(r.spec, acc[j], cnt[j])
            for t in range(acc[j] + 1):
                r.output_ids.append(toks[j][t])
                r.output_logprobs.append(chosen[j][t])
                s.emitted += 1
                if r.extras:
                    _extras(r, v, j, t)
                tok = toks[j][t]
                if tok in r.stop_ids or r.stop_strings or len(r.output_ids) >= r.limit:
                    batch._check_finish(r)
                    if r.finish is not None:
                        break


def _back_off(spec: RowSpec, accepted: int, proposed: int, most: int) -> None:
    if accepted == proposed:
        spec.allowed, spec.misses = min(most, spec.allowed + 1), 0
    elif accepted == 0:
        spec.allowed //= 2
        if spec.allowed == 0:
            spec.misses += 1
            spec.pause, spec.allowed = min(16, 2**spec.misses), 1


def _extras(r: Any, v: Verdict, j: int, t: int) -> None:
    """Top-k and `token_ids_logprob` pairs at emitted position `t` of slot `j`."""
    row = v.scores[j, t : t + 1] - v.lse[j, t : t + 1]  # [1, vocab]
    if r.request.top_logprobs_num > 0:
        r.output_top.append(top_logprobs(row, r.request.top_logprobs_num)[0])
    if r.request.token_ids_logprob:
        r.output_ids_lp.append(ids_logprobs(row, r.request.token_ids_logprob)[0])


def _repack(batch: Any, width: int) -> None:
    """Squeeze the masked holes out of the cache: every slot's live columns right-aligned in
    `width` columns (one gather per layer; the layers re-adopt the tensors at the next update)."""
    order = torch.sort(batch.mask, dim=1, stable=True).indices[:, -width:]  # masked first, live in order
    batch.mask = batch.mask.gather(1, order)
    for layer in batch.cache.layers:
        idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
        layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
        layer._kbuf = layer._vbuf = layer._seen = None  # not views of a buffer: re-adopted
