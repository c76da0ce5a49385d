"""The fair compute floor of one GRPO step: only the work the job needs, in plain torch ops.

A GRPO step of G prompts × n samples needs, and this floor does:
1. **prefill** each distinct prompt once (the G prompts packed into one sequence; attention
   per prompt, causal, no padding);
2. **decode** the live rows only: rows that sampled EOS leave the batch; the linear layers, the
   LM head and sampling see live rows only; each row attends to its group's prompt KV, kept once
   per group (never repeated per row or per head group), and to its own KV in a static buffer;
   each token is drawn by inverting the row's CDF at one uniform (`sample_rows`; a group's first
   tokens from its one prefill distribution);
3. a **train forward** over each distinct prompt once plus every response token once: the linear
   layers see each of those tokens once (no padding); prompts attend causally within themselves,
   each response to its group's prompt and causally to itself (no dense whole-row mask); the LM
   head runs on the positions that predict a response token only (the last prompt position once
   per group), its logits formed once and turned in place into their gradient (`HeadLogprobs`:
   three LM-head matmuls and one `[T, V]` buffer); a grid of slots without padding is read as a
   view of the flat tokens, not gathered (`_Grid`);
4. the **backward** of the token-mean policy-gradient loss;
5. grad-norm clipping and one **fused AdamW** step.

What it still computes beyond the strict minimum, in attention and measured small at these
sizes: in decode, attention runs over every row of the grid (a dead row's query is zero) and
each group's prompt KV is padded to the batch's longest prompt; in the train forward, prompts are
padded to the micro-batch's longest and a group's responses to the group's longest (masked).
Beyond attention: the last token of each response goes through the train forward although no
log-prob reads its output (one token per response: the job as defined above, and as verst and
TRL run it, feeds every response token).

It is a Llama (the benchmarks' models: the reverse-digits model and SmolLM2's architecture),
reusing the Hugging Face module's own weights and RoPE. `check_against_hf` asserts, once per
benchmark run, that its train log-probs equal the model's own padded forward (< 1e-4) and that
its greedy decode equals `model.generate`'s, so the floor computes the same function.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half

NEG = float("-inf")


@dataclass
class Rollout:
    prompts: list[list[int]]  # G distinct prompts
    responses: list[list[list[int]]]  # [G][n] sampled ids (EOS included when sampled)


def sample_rows(logits: torch.Tensor, draws: int = 1) -> torch.Tensor:
    """`draws` tokens per row from `softmax(logits)` by inverse CDF: one uniform per draw, the
    row's CDF built once (in place over `logits`, which it consumes) and searched.
    logits [rows, V] float → [rows * draws] long, row-major.

    The cheapest correct sampler in plain torch at these sizes: two passes over the logits
    (max, then exp + cumsum; the cumsum accumulates in double on CPU) where `torch.multinomial`
    over the softmax cost ~10× as much at [64, 49152], and Gumbel-max draws a noise value per
    vocabulary entry. The draw is in (0, total], so a zero-probability token never comes out."""
    cdf = logits.sub_(logits.amax(-1, keepdim=True)).exp_().cumsum_(-1)  # [rows, V]
    u = 1.0 - torch.rand(cdf.shape[0], draws, dtype=cdf.dtype, device=cdf.device)  # (0, 1]
    return torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=cdf.shape[1] - 1).flatten()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d], cos/sin [T, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def _two_part_attention(
    q: torch.Tensor,  # [G, Hkv, n, gqa, S, d], scaled
    kp: torch.Tensor,  # [G, Hkv, L, d] the group's prompt keys (shared by its n rows)
    vp: torch.Tensor,  # [G, Hkv, L, d]
    prompt_bias: torch.Tensor,  # [G, 1, 1, 1, 1, L] 0 or -inf (prompt padding)
    ks: torch.Tensor,  # [G, Hkv, n, S2, d] the row's own keys
    vs: torch.Tensor,  # [G, Hkv, n, S2, d]
    self_bias: torch.Tensor | None,  # [S, S2] 0 or -inf (causal), None: every own key
) -> torch.Tensor:
    """Softmax attention over [prompt keys ; own keys] without materialising either per row:
    both matmuls are batched views (the head-group axis folded into the query axis)."""
    g, hkv, n, gqa, s, d = q.shape
    big_l, s2 = kp.shape[2], ks.shape[3]
    sp = (q.reshape(g, hkv, n * gqa * s, d) @ kp.transpose(-1, -2)).view(g, hkv, n, gqa, s, big_l)
    ss = (q.reshape(g, hkv, n, gqa * s, d) @ ks.transpose(-1, -2)).view(g, hkv, n, gqa, s, s2)
    sp = sp + prompt_bias
    if self_bias is not None:
        ss = ss + self_bias
    p = torch.softmax(torch.cat([sp, ss], dim=-1), dim=-1)
    out = (p[..., :big_l].reshape(g, hkv, n * gqa * s, big_l) @ vp).view(g, hkv, n, gqa, s, d)
    return out + (p[..., big_l:].reshape(g, hkv, n, gqa * s, s2) @ vs).view(g, hkv, n, gqa, s, d)


@dataclass
class _Grid:
    """Where a grid of token slots (`[G, L]` prompt or `[G, n, R]` response positions) sits in the
    flat token order: `index` holds each slot's flat index (padding points at token 0, `valid`
    False). A grid without padding is the flat range `[start, start + numel)` in grid order, so it
    is read as a view and written back by a reshape: no gather, and no zero-filled scatter in the
    backward (in a micro-batch of one group of equal-length answers, the scale benchmark's case)."""

    index: torch.Tensor  # [*grid] long
    valid: torch.Tensor  # [*grid] bool
    start: int

    def __post_init__(self) -> None:
        self.dense = bool(self.valid.all())

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] flat → [*grid, ...]."""
        if self.dense:
            return x[self.start : self.start + self.index.numel()].view(*self.index.shape, *x.shape[1:])
        return x[self.index]

    def put(self, y: torch.Tensor) -> torch.Tensor:
        """y [*grid, ...] → the valid slots' rows [valid, prod(...)], in flat order."""
        y = y.reshape(self.index.numel(), -1)
        return y if self.dense else y[self.valid.flatten()]


class HeadLogprobs(torch.autograd.Function):
    """`log_softmax(x @ W.T)` at `targets`, with the `[T, V]` logits formed once and kept: the
    forward turns them in place into `exp(logits - max)`, the backward turns that in place into
    the gradient wrt the logits (`scatter(g) - Σg · softmax`), then `grad_x` and `grad_W`. Three
    LM-head matmuls and one `[T, V]` buffer, where autograd through `log_softmax(...).gather`
    allocates the logits, the log-softmax and the gradient of each (a fresh page-faulted buffer
    apiece at these sizes)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """x [T, D], weight [V, D], targets [T, M] → log-probs [T, M]."""
        logits = x @ weight.T  # [T, V]
        picked = logits.gather(1, targets)  # [T, M]
        top = logits.amax(-1, keepdim=True)  # [T, 1]
        total = logits.sub_(top).exp_().sum(-1, keepdim=True)  # logits now hold exp(logits - top)
        ctx.save_for_backward(x, weight, targets, logits, total)
        return picked - top - total.log()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, targets, e, total = ctx.saved_tensors
        g = e.mul_(-grad.sum(-1, keepdim=True) / total).scatter_add_(1, targets, grad)  # [T, V]
        return g @ weight, g.T @ x, None


class FairFloor:
    """The floor's step on a Hugging Face Llama (weights shared with `model`)."""

    def __init__(self, model: Any, lr: float, clip: float = 1.0) -> None:
        cfg = model.config
        if cfg.model_type != "llama":
            raise ValueError(f"the fair floor is written for Llama, not {cfg.model_type!r}")
        self.model, self.clip = model, clip
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.gqa = self.heads // self.kv_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = self.head_dim**-0.5
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)

    # ------------------------------------------------------------ pieces of the decoder

    def _rotary(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.model.model.rotary_emb(like, positions[None])  # [1, T, d]
        return cos[0], sin[0]

    def _qkv(self, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [T, D] → q [T, H, d] (scaled), k/v [T, Hkv, d]."""
        attn, t = layer.self_attn, h.shape[0]
        x = layer.input_layernorm(h)
        q = _rope(attn.q_proj(x).view(t, self.heads, self.head_dim), cos, sin) * self.scale
        k = _rope(attn.k_proj(x).view(t, self.kv_heads, self.head_dim), cos, sin)
        return q, k, attn.v_proj(x).view(t, self.kv_heads, self.head_dim)

    def _finish_layer(self, layer: Any, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = h + layer.self_attn.o_proj(attn_out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(h))

    # ------------------------------------------------------------ generation

    @torch.inference_mode()  # the cheapest no-grad mode (the engine decodes in it too)
    def generate(
        self, prompts: list[list[int]], n: int, max_new: int, eos: int, greedy: bool = False, timings=None
    ) -> Rollout:
        model, g_count = self.model.model, len(prompts)
        lens = [len(p) for p in prompts]
        big_l, rows = max(lens), g_count * n
        t0 = time.perf_counter()
        # prefill: the distinct prompts packed, attention per prompt
        flat = torch.tensor([t for p in prompts for t in p])
        pos = torch.cat([torch.arange(k) for k in lens])
        h = model.embed_tokens(flat)
        cos, sin = self._rotary(pos, h)
        shape = (g_count, self.kv_heads, big_l, self.head_dim)
        kp = [h.new_zeros(shape) for _ in model.layers]
        vp = [h.new_zeros(shape) for _ in model.layers]
        for li, layer in enumerate(model.layers):
            q, k, v = self._qkv(layer, h, cos, sin)
            outs, start = [], 0
            for gi, k_len in enumerate(lens):
                sl = slice(start, start + k_len)
                kp[li][gi, :, :k_len] = k[sl].transpose(0, 1)
                vp[li][gi, :, :k_len] = v[sl].transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    q[sl].transpose(0, 1)[None], k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None],
                    is_causal=True, scale=1.0, enable_gqa=True,
                )  # fmt: skip
                outs.append(o[0].transpose(0, 1).reshape(k_len, -1))
                start += k_len
            h = self._finish_layer(layer, h, torch.cat(outs))
        last = torch.tensor(lens).cumsum(0) - 1  # [G]
        first_logits = self._head(h[last])  # [G, V]
        t1 = time.perf_counter()
        # decode: row r = g * n + j; live rows only through the linear layers and the head
        prompt_bias = torch.where(torch.arange(big_l)[None] < torch.tensor(lens)[:, None], 0.0, NEG)
        prompt_bias = prompt_bias.view(g_count, 1, 1, 1, 1, big_l)
        kr = [h.new_zeros(g_count, self.kv_heads, n, max_new, self.head_dim) for _ in model.layers]
        vr = [torch.zeros_like(b) for b in kr]
        tok = self._sample(first_logits, greedy, n)  # [rows]: n draws from each group's distribution
        out = [[[] for _ in range(n)] for _ in range(g_count)]
        live = torch.arange(rows)
        row_pos = torch.tensor(lens).repeat_interleave(n)  # next position per row
        for step in range(max_new):
            for r, t in zip(live.tolist(), tok.tolist(), strict=True):
                out[r // n][r % n].append(t)
            keep = tok != eos
            if step == max_new - 1 or not bool(keep.any()):
                break
            live, tok = live[keep], tok[keep]
            g_idx, j_idx = live // n, live % n
            h = model.embed_tokens(tok)  # [b, D]
            cos, sin = self._rotary(row_pos[live], h)
            for li, layer in enumerate(model.layers):
                q, k, v = self._qkv(layer, h, cos, sin)
                kr[li][g_idx, :, j_idx, step] = k
                vr[li][g_idx, :, j_idx, step] = v
                q_grid = h.new_zeros(g_count, n, self.kv_heads, self.gqa, self.head_dim)
                q_grid[g_idx, j_idx] = q.view(-1, self.kv_heads, self.gqa, self.head_dim)
                q_grid = q_grid.permute(0, 2, 1, 3, 4).unsqueeze(4)  # [G, Hkv, n, gqa, 1, d]
                o = _two_part_attention(
                    q_grid.contiguous(), kp[li], vp[li], prompt_bias,
                    kr[li][:, :, :, : step + 1], vr[li][:, :, :, : step + 1], None,
                )  # fmt: skip
                o = o.squeeze(4).permute(0, 2, 1, 3, 4)[g_idx, j_idx]  # [b, Hkv, gqa, d]
                h = self._finish_layer(layer, h, o.reshape(len(live), -1))
            tok = self._sample(self._head(h), greedy)  # the fresh logits are consumed in place
            row_pos[live] += 1
        if timings is not None:
            timings["prefill_s"] = t1 - t0
            timings["decode_s"] = time.perf_counter() - t1
        return Rollout(prompts, out)

    @staticmethod
    def _sample(logits: torch.Tensor, greedy: bool, draws: int = 1) -> torch.Tensor:
        """`draws` tokens per row of `logits` [rows, V] → [rows * draws], row-major."""
        if greedy:
            return logits.argmax(-1).repeat_interleave(draws)
        return sample_rows(logits.float(), draws)  # float32 logits: the same tensor, consumed

    # ------------------------------------------------------------ training

    def logprobs(self, ro: Rollout) -> torch.Tensor:
        """Log-probs of every response token, flat in (group, row, token) order."""
        model = self.model.model
        g_count, n = len(ro.prompts), len(ro.responses[0])
        lens = [len(p) for p in ro.prompts]
        rlens = [[len(r) for r in grp] for grp in ro.responses]
        big_l, big_r = max(lens), max(max(x) for x in rlens)
        # flat order: every prompt token, then every response token (group, row, position)
        ids = [t for p in ro.prompts for t in p] + [t for grp in ro.responses for r in grp for t in r]
        pos = [i for k in lens for i in range(k)]
        pos += [lens[g] + i for g in range(g_count) for r in rlens[g] for i in range(r)]
        n_prompt = sum(lens)
        # grid -> flat indices (padding points at token 0 and is masked)
        p_grid = torch.zeros(g_count, big_l, dtype=torch.long)
        p_valid = torch.zeros(g_count, big_l, dtype=torch.bool)
        r_grid = torch.zeros(g_count, n, big_r, dtype=torch.long)
        r_valid = torch.zeros(g_count, n, big_r, dtype=torch.bool)
        start, r_start = 0, n_prompt
        for g in range(g_count):
            p_grid[g, : lens[g]] = torch.arange(start, start + lens[g])
            p_valid[g, : lens[g]] = True
            start += lens[g]
            for j in range(n):
                k = rlens[g][j]
                r_grid[g, j, :k] = torch.arange(r_start, r_start + k)
                r_valid[g, j, :k] = True
                r_start += k
        prompt_bias = torch.where(p_valid, 0.0, NEG).view(g_count, 1, 1, 1, 1, big_l)
        causal = torch.triu(torch.full((big_r, big_r), NEG), 1)
        pg, rg = _Grid(p_grid, p_valid, 0), _Grid(r_grid, r_valid, n_prompt)
        h = model.embed_tokens(torch.tensor(ids))
        cos, sin = self._rotary(torch.tensor(pos), h)
        hkv, gqa, d = self.kv_heads, self.gqa, self.head_dim
        for layer in model.layers:
            q, k, v = self._qkv(layer, h, cos, sin)
            kp = pg.take(k).permute(0, 2, 1, 3)  # [G, Hkv, L, d]
            vp = pg.take(v).permute(0, 2, 1, 3)
            qp = pg.take(q).permute(0, 2, 1, 3)  # [G, H, L, d]
            po = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=1.0, enable_gqa=True)
            po = pg.put(po.permute(0, 2, 1, 3))
            qr = rg.take(q).view(g_count, n, big_r, hkv, gqa, d).permute(0, 3, 1, 4, 2, 5)
            kr = rg.take(k).permute(0, 3, 1, 2, 4)  # [G, Hkv, n, R, d]
            vr = rg.take(v).permute(0, 3, 1, 2, 4)
            ro_ = _two_part_attention(qr.contiguous(), kp, vp, prompt_bias, kr, vr, causal)
            ro_ = rg.put(ro_.permute(0, 2, 4, 1, 3, 5))
            h = self._finish_layer(layer, h, torch.cat([po, ro_]))
        # the LM head: the last prompt position once per group, then each response token but its last
        norm, weight = model.norm, self.model.lm_head.weight
        last = torch.tensor(lens).cumsum(0) - 1
        firsts = torch.tensor([r[0] for grp in ro.responses for r in grp]).view(g_count, n)
        first_lp = HeadLogprobs.apply(norm(h[last]), weight, firsts).flatten()  # [G * n]
        ids_t = torch.tensor(ids)
        inner = r_valid[:, :, 1:]  # token i of a row predicts token i + 1
        target_at = r_grid[:, :, 1:][inner]  # flat indices of the predicted tokens
        inner_lp = HeadLogprobs.apply(norm(h[r_grid[:, :, :-1][inner]]), weight, ids_t[target_at][:, None])
        inner_lp = inner_lp[:, 0]
        order = torch.cat([r_grid[:, :, 0].flatten(), target_at]) - n_prompt
        return first_lp.new_zeros(len(ids) - n_prompt).scatter(0, order, torch.cat([first_lp, inner_lp]))

    def train(
        self, ro: Rollout, advantages: torch.Tensor, groups_per_micro: int | None = None, timings=None
    ) -> None:
        """Token-mean policy gradient (`advantages` [G * n], one per row) over micro-batches of
        whole groups, backward per micro-batch, then clip and AdamW."""
        n, g_count = len(ro.responses[0]), len(ro.prompts)
        per = groups_per_micro or g_count
        counts = torch.tensor([len(r) for grp in ro.responses for r in grp])
        total = counts.sum()
        self.opt.zero_grad(set_to_none=True)
        forward = backward = 0.0
        for g in range(0, g_count, per):
            t0 = time.perf_counter()
            sub = Rollout(ro.prompts[g : g + per], ro.responses[g : g + per])
            rows = slice(g * n, (g + per) * n)
            logp = self.logprobs(sub)
            loss = -(advantages[rows].repeat_interleave(counts[rows]) * logp).sum() / total
            t1 = time.perf_counter()
            loss.backward()
            forward, backward = forward + t1 - t0, backward + time.perf_counter() - t1
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        if timings is not None:
            timings["train_forward_s"], timings["backward_s"] = forward, backward
            timings["optimizer_s"] = time.perf_counter() - t2

    def step(
        self, prompts: list[list[int]], n: int, max_new: int, eos: int, groups_per_micro: int | None = None
    ) -> dict[str, float]:
        """One timed GRPO step of the floor (random advantages: a step's cost does not depend on their
        values, but the model they move does, through the next steps' response lengths)."""
        timings: dict[str, float] = {}
        self.model.train()
        ro = self.generate(prompts, n, max_new, eos, timings=timings)
        self.train(ro, torch.randn(len(prompts) * n), groups_per_micro, timings=timings)
        return timings


def check_against_hf(model: Any, prompts: list[list[int]], n: int, max_new: int, eos: int, pad: int) -> float:
    """The floor computes the model's function: greedy decode equal to `generate`, train log-probs
    equal to the model's padded forward. Returns the largest log-prob difference."""
    floor = FairFloor(model, lr=0.0)
    greedy = floor.generate(prompts, 1, max_new, eos, greedy=True)
    for p, (got,) in zip(prompts, greedy.responses, strict=True):
        ref = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                             pad_token_id=pad)[0, len(p):].tolist()  # fmt: skip
        ref = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert got == ref, f"the floor's greedy decode {got} differs from generate's {ref}"
    sampled = floor.generate(prompts, n, max_new, eos)
    with torch.no_grad():
        mine = floor.logprobs(sampled)
        ref = []
        for p, grp in zip(sampled.prompts, sampled.responses, strict=True):
            for r in grp:
                logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
                ref.append(torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(r)[:, None])[:, 0])
    diff = (mine - torch.cat(ref)).abs().max().item()
    assert diff < 1e-4, f"the floor's log-probs differ from the model's by {diff}"
    return diff
