"""Draft-model proposals: a smaller causal LM with the target's tokenizer proposes `k` tokens.

Each step the draft reads every proposing row's last `context_window` tokens (left-padded, one
forward with a cache of its own for this step), then decodes `k − 1` more tokens on that cache;
each proposal is drawn from the draft's distribution filtered like the target's (the row's
temperature, top-k, top-p; greedy rows take the argmax), and those distributions `q` go to the
verification (`verify.verify`). A seeded row's draws come from (seed, position) on their own
stream (`verify.DRAFT_SALT`). The draft keeps no cache across steps (each step re-reads the
window: simple, and correct through merges, compaction and aborts; its cost grows with the
window, which is why it is bounded). `refit = "with_policy"` copies every tensor of a policy
weight update whose name and shape the draft also has (a draft made of the policy's own first
layers follows the policy); `"fixed"` keeps the draft as loaded.
"""

from __future__ import annotations

from typing import Any

import torch

from verst.rollout.engines.embedded.sampling import BatchSampling
from verst.rollout.engines.embedded.speculative.verify import DRAFT_SALT, _inverse_cdf, draws, filtered_probs


class DraftModelProposer:
    """Proposals drawn from a draft model (see the module doc)."""

    def __init__(self, model: Any, *, context_window: int, refit: str, vocab: int) -> None:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if int(cfg.vocab_size) != vocab:
            raise ValueError(
                f"the draft model's vocabulary has {cfg.vocab_size} entries, the target's {vocab}: "
                "a draft must share the target's tokenizer (engine.speculative.model_path)"
            )
        self.model = model.eval()
        self.context_window = context_window
        self.refit_mode = refit
        self.vocab = vocab

    def propose(self, batch: Any, rows: list[Any], caps: list[int]) -> tuple[list[list[int]], torch.Tensor]:
        """Per row up to `caps[i]` tokens, and their distributions `[rows, k, vocab]`."""
        device = batch.device
        live = [i for i, c in enumerate(caps) if c > 0]
        k = max(caps)
        q = torch.zeros((len(rows), k, self.vocab), device=device)
        out: list[list[int]] = [[] for _ in rows]
        ctxs = [(rows[i].request.input_ids + rows[i].output_ids)[-self.context_window :] for i in live]
        width = max(len(c) for c in ctxs)
        ids = torch.zeros((len(live), width), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for j, c in enumerate(ctxs):
            ids[j, width - len(c) :] = torch.tensor(c, device=device)
            mask[j, width - len(c) :] = 1
        s = BatchSampling.build([rows[i].sampling for i in live], self.vocab, device)
        start = torch.tensor([rows[i].prompt_len + len(rows[i].output_ids) for i in live], device=device)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        res = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache, nxt = res.past_key_values, pos[:, -1] + 1
        toks: list[torch.Tensor] = []
        for t in range(k):
            tok, dist = self._draw(res.logits[:, -1], s, start + t)
            toks.append(tok)
            q[live, t] = dist
            if t + 1 < k:
                mask = torch.cat([mask, mask.new_ones((len(live), 1))], 1)
                res = self.model(
                    input_ids=tok[:, None], attention_mask=mask, position_ids=nxt[:, None] + t,
                    past_key_values=cache, use_cache=True,
                )
        drawn = torch.stack(toks, 1).tolist()  # [live, k]
        for j, i in enumerate(live):
            out[i] = drawn[j][: caps[i]]
        return out, q

    @staticmethod
    def _draw(logits: torch.Tensor, s: BatchSampling, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A token per row from the draft's filtered distribution, and that distribution."""
        scores = logits.float() * s.inv_temp
        dist = filtered_probs(scores[:, None], s)[:, 0]  # [rows, vocab]
        tok = _inverse_cdf(dist, draws(s, positions[:, None], DRAFT_SALT)[:, 0])
        greedy = scores.argmax(-1)
        tok = torch.where(s.greedy, greedy, tok)
        point = torch.zeros_like(dist).scatter_(-1, greedy[:, None], 1.0)
        return tok, torch.where(s.greedy[:, None], point, dist)

    def refit(self, named: dict[str, Any]) -> None:
        """`with_policy`: copy the update's tensors the draft has under the same name and shape."""
        if self.refit_mode != "with_policy":
            return
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named.items():
                if name in state and tuple(state[name].shape) == tuple(tensor.shape):
                    state[name].copy_(tensor)
