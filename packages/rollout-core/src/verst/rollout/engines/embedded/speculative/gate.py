"""The cost gate (`engine.speculative.gate = "auto"`): speculate only where it is expected to pay.

A verify forward feeds `k + 1` tokens per row. When a forward is overhead- or memory-bound (few
rows, a GPU) that costs little more than a plain step; when it is compute-bound (many rows on a
CPU) it costs about `k + 1` plain steps, and speculation that is not almost always accepted is
slower than plain decoding. The gate weighs, before each step, the expected tokens against the
expected cost:

- each row's acceptance `a` is an EMA of the fraction of its proposed tokens accepted (its own
  verification steps only; a new row starts at `fresh`, an EMA over the rows' first
  verifications, or at `prior` if it is seeded or nothing was verified yet). A row proposing
  `m` tokens is expected to emit `(1 - a^(m+1)) / (1 - a)` tokens (1 when it proposes nothing).
  Why first verifications, not every one: a copy's rows accept at their start and fail where
  the copy ends (a tool_math answer: 4 of 4, then 0 of 4 at its EOS), and an EMA over all
  verifications (0.47 there) priced a new row's first step at 1.9 tokens against a measured
  1.5–1.7 plain steps: on a noisy box the gate sent a fifth of the steps, whole requests,
  through plain decoding (`benchmarks/speculative.py --tasks tool_math`, 1 row);
- the cost of a verify forward of `k + 1` tokens relative to a plain step is measured: EMAs of
  the wall time of plain steps and of verify steps per `k` (per row of the batch); until both are
  seen it is modelled as `1 + verify_cost * k`;
- the step speculates with the `k` (1 … the longest proposal allowed) that maximises expected
  tokens per unit cost, if that beats plain decoding's (`n` tokens per plain step); otherwise
  it runs plain. After `probe_gap` plain steps in a row one verification step (`k = 1`) runs
  anyway, so the acceptance estimates stay current: the gap starts at `probe_min`, doubles after
  each probe that does not turn speculation back on, up to `probe_every`, and resets once
  speculation pays again; a probe (or any verification) whose proposals all pass resets it
  to `probe_min` too, so the estimates catch up within a few steps of a copy beginning (before,
  at 1 row a request starting with failing proposals often ran its whole 32 tokens plain while
  the gap doubled: the tiny greedy loop speculated 37% of its steps with the gate, against 1.82×
  plain without it). A workload whose proposals start paying again (a copy begins after a
  free-form stretch, or one slow forward made a verify step look expensive) is back on within a
  few steps; one whose proposals keep failing pays about `log2(probe_every / probe_min)` probes,
  then one step in `probe_every`.

Seeded rows decide alone (their proposal length depends only on their own acceptance, the
modelled cost and their own probe schedule, `RowSpec.probe_at` / `probe_gap`, counted in their
own output tokens, never on timings or on what shares the batch), so a seeded request stays
reproducible; when a seeded row speculates the step verifies, and the other rows' proposals
ride along at the same `k`.

Why the gate does not bias the output distribution: whether a step speculates, and how far,
depends only on the past (acceptance of earlier steps, timings of earlier forwards), never on
the current step's draws or logits. Conditioned on the history, a plain step emits a sample of
the target's filtered distribution and so does a verification step (the speculative-sampling
rule, `verify`); a choice between two exact samplers made before either draws is still an exact
sampler (a stopping-time argument: the token's law given the history is the target's in both
branches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class CostGate:
    """The gate's state: timings and the decision (see the module doc)."""

    verify_cost: float = 0.5
    prior: float = 0.6
    decay: float = 0.3
    probe_every: int = 64
    """The longest gap between probes (plain steps for unseeded rows, output tokens for seeded)."""
    probe_min: int = 4
    """The first gap after speculation stops paying (doubling per failed probe)."""
    probe_gap: int = 4
    """The unseeded rows' current gap (plain steps in a row before a probe)."""
    plain_t: float | None = None
    """EMA of a plain step's wall time per row."""
    verify_t: dict[int, float] = field(default_factory=dict)
    """EMA of a verify step's wall time per row, by `k`."""
    plain_run: int = 0
    """Plain steps since the last verification step."""
    fresh: float | None = None
    """EMA of the acceptance of rows' first verifications: a new unseeded row's estimate."""

    def ratio(self, k: int) -> float:
        """Cost of a verify forward of `k + 1` tokens over a plain step's."""
        t = self.verify_t.get(k)
        if t is None or self.plain_t is None:
            return 1.0 + self.verify_cost * k
        return max(1.0, t / self.plain_t)

    def observe(self, k: int, seconds: float, rows: int) -> None:
        """A step's wall time (`k = 0`: plain)."""
        per = seconds / max(1, rows)
        if k == 0:
            self.plain_t = per if self.plain_t is None else self.plain_t + self.decay * (per - self.plain_t)
            self.plain_run += 1
        else:
            old = self.verify_t.get(k)
            self.verify_t[k] = per if old is None else old + self.decay * (per - old)
            self.plain_run = 0

    def update(self, spec: Any, accepted: int, proposed: int) -> None:
        """A row's acceptance EMA after one of its verification steps."""
        frac = accepted / proposed
        if accepted == proposed:  # it passed: probe at the shortest gap until speculation pays
            self.probe_gap = self.probe_min
            spec.probe_at = None
        if spec.accept is None:  # the row's first verification
            self.fresh = frac if self.fresh is None else self.fresh + 0.1 * (frac - self.fresh)
        spec.accept = frac if spec.accept is None else spec.accept + self.decay * (frac - spec.accept)

    def choose(self, rows: list[Any], caps: list[int]) -> list[int]:
        """Each row's proposal cap for this step (all 0: run plain)."""
        top = max(caps)
        if top == 0:
            return caps
        seeded = [r.sampling.seed is not None for r in rows]
        fresh = [self.prior if s or self.fresh is None else self.fresh for s in seeded]
        acc = [f if r.spec.accept is None else r.spec.accept for r, f in zip(rows, fresh, strict=True)]
        own = [0] * len(rows)  # seeded rows: their own choice, from their own history only
        for i, (a, c, s) in enumerate(zip(acc, caps, seeded, strict=True)):
            if s and c:
                k, g = _best_k([a], [c], 1, self._model)
                own[i] = k if g > 1.0 else (1 if self._row_probe(rows[i]) else 0)
                if g > 1.0:
                    rows[i].spec.probe_at = None
        free = [c if not s else 0 for c, s in zip(caps, seeded, strict=True)]
        k, gain = _best_k(acc, free, len(rows), self.ratio) if any(free) else (0, 0.0)
        if gain > 1.0:
            self.probe_gap = self.probe_min
        else:
            probe = self.plain_run >= self.probe_gap
            k = 1 if (any(own) or probe) and any(free) else 0
            if probe and k:
                self.probe_gap = min(self.probe_every, 2 * self.probe_gap)
        return [o if s else min(c, k) for o, c, s in zip(own, caps, seeded, strict=True)]

    def _row_probe(self, row: Any) -> bool:
        """Whether a seeded row that does not expect speculation to pay probes now (its own
        schedule, counted in its output tokens: the first probe `probe_min` tokens after it
        stopped, then doubling gaps up to `probe_every`)."""
        spec, n = row.spec, len(row.output_ids)
        if spec.probe_at is None:
            spec.probe_gap = self.probe_min
            spec.probe_at = n + spec.probe_gap
            return False
        if n < spec.probe_at:
            return False
        spec.probe_gap = min(self.probe_every, 2 * spec.probe_gap)
        spec.probe_at = n + spec.probe_gap
        return True

    def _model(self, k: int) -> float:
        return 1.0 + self.verify_cost * k


def expected_tokens(a: float, m: int) -> float:
    """Tokens a row emits in one verification step proposing `m`, each accepted w.p. `a`."""
    if m == 0:
        return 1.0
    if a >= 1.0:
        return float(m + 1)
    return (1.0 - a ** (m + 1)) / (1.0 - a)


def _best_k(acc: list[float], caps: list[int], n: int, ratio: Any) -> tuple[int, float]:
    """The `k` maximising expected tokens per cost over the rows, and its gain over plain (n)."""
    best, gain = 0, 0.0
    for k in range(1, max(caps) + 1):
        tokens = sum(expected_tokens(a, min(c, k)) for a, c in zip(acc, caps, strict=True))
        g = tokens / (n * ratio(k))
        if g > gain:
            best, gain = k, g
    return best, gain
