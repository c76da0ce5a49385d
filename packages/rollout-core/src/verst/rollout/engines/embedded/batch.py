"""The running decode batch of the embedded engine: rows, their KV cache, prefill, merge, step.

Continuous batching on transformers' `DynamicCache`: a group of new requests is prefilled
together (left-padded, in forwards of prompts of similar length: `embedded.prefill`; identical
prompts once, see `DecodeBatch.admit`), its first token sampled, and the group is merged into
the running batch between decode steps (the shorter cache is left-padded with masked zeros). A
finished row leaves `rows` at once, but its slot in
the batch tensors stays (decoded and ignored) until a quarter of the slots are dead or new rows
merge: then the cache is compacted with `batch_select_indices`, one copy for many departures
instead of one per departure. Cache columns that every remaining row masks out are trimmed.
The cache's layers grow in place (`embedded.kv_cache`).
On CPU with the direct decode step, a batch admitted with shared prompts decodes in the split
layout: each distinct prompt's KV kept once (`embedded.shared_prefix.PrefixKV`, its groups
dropped and merged with the slots) and the cache holding each row's own tokens only; a batch
keeps its layout until it empties (rows merging into a flat batch are copied, as before). The
`model(...)` path (vision-language models, other families, eager attention) and CUDA keep the
flat layout: `TwoPartAttention` is measured on CPU only.
Positions are explicit (`position_ids`), so padding never shifts RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from verst.rollout.engine import FinishReason, GenerateRequest
from verst.rollout.engines.embedded.direct import DirectDecode
from verst.rollout.engines.embedded.exact import exact_step_scores
from verst.rollout.engines.embedded.kv_cache import cat_left_padded, growing_cache
from verst.rollout.engines.embedded.prefill import PrefillModel, prefill
from verst.rollout.engines.embedded.ragged import prefill_group_tokens
from verst.rollout.engines.embedded.sampling import (
    BatchSampling,
    PromptScores,
    RowSampling,
    StepScores,
    ids_logprobs,
    prompt_scores,
    sample,
    top_logprobs,
)
from verst.rollout.engines.embedded.shared_prefix import PrefixKV, empty_suffix
from verst.rollout.engines.embedded.vision import prefill_kwargs
from verst.rollout.moe import RouterHooks
from verst.rollout.multimodal.processor import image_key


@dataclass(slots=True)
class Row:
    """One request being decoded (or waiting to be)."""

    request: GenerateRequest
    """The request as submitted (rid assigned)."""
    sampling: RowSampling
    """Resolved sampling settings."""
    stop_ids: frozenset[int]
    """Token ids that end the request (EOS unless ignore_eos, plus stop_token_ids)."""
    context_len: int
    """Model context length: prompt + output never exceeds it."""
    output_ids: list[int] = field(default_factory=list)
    """Generated tokens."""
    output_logprobs: list[float] = field(default_factory=list)
    """Their log-probs."""
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    """Top-k pairs per output position (when asked)."""
    output_ids_lp: list[list[tuple[float, int]]] = field(default_factory=list)
    """`token_ids_logprob` pairs per output position (when asked)."""
    input_logprobs: list[float | None] | None = None
    """Prompt log-probs (when asked)."""
    input_top: list[list[tuple[float, int]] | None] | None = None
    """Prompt top-k pairs (when asked)."""
    input_ids_lp: list[list[tuple[float, int]] | None] | None = None
    """Prompt `token_ids_logprob` pairs (when asked)."""
    finish: FinishReason | None = None
    """Set when the row is done."""
    matched: int | str | None = None
    """The stop token id or stop string that ended it."""
    handle: Any = None
    """The engine's completion handle (future, loop, stream queue)."""
    routing: list[torch.Tensor] = field(default_factory=list)
    """MoE models: the experts chosen at each fed position, in chunks (`[n, layers × k]`, CPU)."""
    limit: int = 0
    """Output tokens after which the row ends by length (its budget, or the context's room)."""
    extras: bool = False
    """It asks for more than the sampled token's log-prob (top-k or `token_ids_logprob` pairs)."""
    stop_strings: bool = False
    """It has stop strings (checked on the decoded tail after every token)."""
    spec: Any = None
    """Its speculative-decoding state (`embedded.speculative.step.RowSpec`), when enabled."""

    def __post_init__(self) -> None:
        req = self.request
        self.limit = min(req.sampling.max_new_tokens, self.context_len - len(req.input_ids))
        self.extras = req.top_logprobs_num > 0 or bool(req.token_ids_logprob)
        self.stop_strings = bool(req.sampling.stop)

    @property
    def prompt_len(self) -> int:
        return len(self.request.input_ids)


def _set_scores(row: Row, scores: PromptScores) -> None:
    """Give the row its own copy of (possibly shared) prompt scores."""
    chosen, top, by_id = scores
    row.input_logprobs = list(chosen)
    row.input_top = None if top is None else list(top)
    row.input_ids_lp = None if by_id is None else list(by_id)


def _inv_temp(row: Row) -> float:
    t = row.sampling.temperature
    return 1.0 / t if t > 0 else 1.0


def share_groups(rows: list[Row]) -> tuple[list[int], list[int]]:
    """Rows with the same prompt, adapter and images (hash and place) share one prefill.

    Returns (`unique`: index in `rows` of the first row of each distinct (prompt, adapter), in
    order; `source`: for every row, the position in `unique` of the row it shares with).
    """
    first: dict[tuple[Any, ...], int] = {}
    unique: list[int] = []
    source: list[int] = []
    for i, r in enumerate(rows):
        key = (tuple(r.request.input_ids), r.request.lora_path, image_key(r.request.images))
        if key not in first:
            first[key] = len(unique)
            unique.append(i)
        source.append(first[key])
    return unique, source


def _spare_for(rows: list[Row]) -> int:
    """The most tokens any of `rows` may still feed (at least 1): the cache's spare columns."""
    left = max(
        min(
            r.request.sampling.max_new_tokens - len(r.output_ids),
            r.context_len - r.prompt_len - len(r.output_ids),
        )
        for r in rows
    )
    return max(1, left)


def _set_spare(cache: Any, rows: list[Row]) -> None:
    """Size the cache's spare columns to the most tokens any of `rows` may still feed."""
    spare = _spare_for(rows)
    for layer in cache.layers:
        layer.spare = spare


def _wants_input(row: Row) -> bool:
    return row.request.return_logprob and row.request.logprob_start_len == 0


class DecodeBatch:
    """Rows being decoded together, with their shared KV cache."""

    def __init__(self, model: Any, pad_id: int, tokenizer: Any) -> None:
        self.model = model
        self.pad_id = pad_id
        self.tokenizer = tokenizer
        self.rows: list[Row] = []
        """The live rows, in slot order."""
        self.slots: list[int] | None = None
        """Each live row's slot in the batch tensors (None: row i is slot i, no dead slots)."""
        self.slot_rows: list[Row] = []
        """The row of every slot, finished ones included (what LoRA routing sees)."""
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [batch, cols] long; 1 = real token
        self.next_pos: torch.Tensor | None = None  # [batch] long; position of the next fed token
        self.last: torch.Tensor | None = None  # [batch] long; sampled, not yet fed
        self.sampling: BatchSampling | None = None
        self.device = next(model.parameters()).device
        cfg = model.config
        self.vocab = int((cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg).vocab_size)
        self.adapters: Any = None
        """LoRA adapters (`verst.rollout.engines.embedded.lora.EngineAdapters`), told each forward's rows."""
        self.vision: Any = None
        """The `MultimodalProcessor` of a vision-language model (None: text only)."""
        self.share_prefix = True
        """Prefill rows with the same prompt and adapter once (see `admit`)."""
        self.share_decode = True
        """On CPU with the direct step, keep a shared prompt's KV once while decoding (see `admit`)."""
        self.exact = False
        """`train.exact_on_policy`: batch-invariant ops, the trainer's log-probs (`embedded.exact`)."""
        self.prefix: PrefixKV | None = None
        """The split layout's prompt KV (`embedded.shared_prefix`); None: the flat layout."""
        self.prefill_rows = 0
        """Rows admitted through `admit` so far."""
        self.prefill_tokens = 0
        """Prompt tokens run through prefill forwards so far (padding not counted)."""
        self.prefill_tokens_saved = 0
        """Prompt tokens not run because their row shared another row's prefill."""
        self.routers = RouterHooks.of(model)
        """MoE models: records every forward's expert choices (rows keep theirs, `Row.routing`)."""
        growing_cache(model.config)  # fail at construction for unsupported cache layouts
        self.direct: DirectDecode | None = DirectDecode.of(model)
        """The decode step without the model's wrappers (`embedded.direct`); None: `model(...)`."""
        self.prefill_group_cost = prefill_group_tokens(self.device)
        """One more prefill forward's cost in padded tokens (`ragged.split_by_width`)."""
        self.speculative: Any = None
        """`embedded.speculative.step.SpeculativeDecoder` (None: plain decoding); it keeps the flat layout."""

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def _prefill_model(self) -> PrefillModel:
        return PrefillModel(self.model, self.pad_id, self.device, self.vision, self.routers, self._route)

    def _route(self, rows: list[Row]) -> None:
        """Tell the adapters which rows (in order) the next forward carries."""
        if self.adapters is not None:
            self.adapters.select([r.request.lora_path for r in rows], self.device)

    # ---- scoring and prefill -------------------------------------------------------------
    def score(self, row: Row) -> None:
        """`max_new_tokens = 0`: one forward over the prompt, no padding; fills prompt scores."""
        ids = torch.tensor([row.request.input_ids], device=self.device)  # [1, prompt]
        self._route([row])
        inputs = prefill_kwargs(self.vision, self.model, ids, [row])
        logits = self.model(**inputs, use_cache=False).logits[0]  # [prompt, vocab]
        if self.routers is not None:
            row.routing = [self.routers.take_rows()]
        if _wants_input(row) or row.request.top_logprobs_num or row.request.token_ids_logprob:
            _set_scores(row, prompt_scores(row.request, logits, _inv_temp(row)))
        row.finish = "length"

    def admit(self, rows: list[Row]) -> None:
        """Prefill `rows` together, sample their first token, and merge them into the batch.

        Prompts of similar length run through the model together (`embedded.prefill`: less
        padding). Rows with the same prompt and adapter (a GRPO group's n samples) are prefilled
        once: the forward runs over the distinct prompts only, and its KV cache, mask, positions,
        last logits and prompt scores are copied to every row that shares them (sampling stays
        per row, each seeded row by its own seed). The prompt's KV is copied into each row's own
        cache storage (the flat layout), or, in the split layout (`_split`), kept once for the
        whole group while each row's cache holds its own tokens (`embedded.shared_prefix`).
        """
        every = list(range(len(rows)))
        unique, source = share_groups(rows) if self.share_prefix else (every, every)
        firsts = [rows[u] for u in unique]
        full = any(_wants_input(r) for r in rows)
        split = self._split(len(rows), len(firsts))
        spare = 1 if split else _spare_for(rows)  # split: the prompt's columns never grow
        done = prefill(self._prefill_model, firsts, spare, full, self.prefill_group_cost)
        if done.routing is not None:  # each row its prompt's (shared) routing
            for r, u in zip(rows, source, strict=True):
                r.routing = [done.routing[u]]
        self.prefill_rows += len(rows)
        self.prefill_tokens += sum(r.prompt_len for r in firsts)
        self.prefill_tokens_saved += sum(r.prompt_len for r in rows) - sum(r.prompt_len for r in firsts)
        index = torch.tensor(source, device=self.device)  # [new]; row → its unique prefill
        cache, mask, last, prefix = self._shared(done, rows, index, split)
        if done.logits is not None:
            memo: dict[tuple[Any, ...], PromptScores] = {}
            for r, u in zip(rows, source, strict=True):
                if _wants_input(r):
                    q = r.request
                    key = (u, _inv_temp(r), q.top_logprobs_num, tuple(q.token_ids_logprob or ()))
                    if key not in memo:
                        memo[key] = prompt_scores(q, done.logits[u], _inv_temp(r))
                    _set_scores(r, memo[key])
        pos = done.mask.sum(1)[index]  # each row's prompt length: the position of its first token
        sampling = BatchSampling.build([r.sampling for r in rows], self.vocab, self.device)
        tokens, lps = sample(last, sampling, pos)
        if self.exact:  # the trainer's op on the same logits (`embedded.exact`)
            lps = exact_step_scores(last, sampling.inv_temp)
        self._record(rows, tokens, lps)
        self._compact()
        self._merge(rows, cache, mask, pos, tokens, prefix)

    def _split(self, rows: int, distinct: int) -> bool:
        """Whether admitted rows decode in the split layout (`embedded.shared_prefix`): a batch
        keeps its layout until it empties; an empty one splits when some admitted rows share a
        prompt, on CPU with the direct step (`DirectDecode` serves `TwoPartAttention`; the
        `model(...)` path and CUDA keep the flat layout)."""
        if self.rows:
            return self.prefix is not None
        cpu = self.device.type == "cpu"
        flat_only = self.speculative is not None  # its verification forward runs `model(...)`
        return self.share_decode and self.direct is not None and cpu and distinct < rows and not flat_only

    def _shared(
        self, done: Any, rows: list[Row], index: torch.Tensor, split: bool
    ) -> tuple[Any, torch.Tensor, torch.Tensor, PrefixKV | None]:
        """(cache, mask, last logits, prefix) of admitted `rows` from the prefill of their distinct
        prompts: split, the prompts' KV once (`PrefixKV`) and an empty cache for each row's own
        tokens; flat, every row its own copy of its prompt's KV, mask and logits."""
        if split:
            cache = empty_suffix(self.model.config, done.cache, len(rows), _spare_for(rows))
            mask = done.mask.new_zeros((len(rows), 0))
            return cache, mask, done.last[index], PrefixKV.of(done.cache, done.mask, index)
        cache, mask, last = done.cache, done.mask, done.last
        if done.mask.shape[0] < len(rows):
            cache.batch_select_indices(index)  # index_select: every row its own copy
            mask, last = mask[index], last[index]
        return cache, mask, last, None

    def _merge(
        self,
        rows: list[Row],
        cache: Any,
        mask: torch.Tensor,
        pos: torch.Tensor,
        last: torch.Tensor,
        prefix: PrefixKV | None,
    ) -> None:
        if not self.rows:
            self.rows, self.cache, self.mask, self.next_pos, self.last = rows, cache, mask, pos, last
            self.prefix = prefix
            self.slot_rows = rows
            self._resample()
            return
        assert self.mask is not None and self.next_pos is not None and self.last is not None
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = cat_left_padded(mine.keys, theirs.keys, 2)
            mine.values = cat_left_padded(mine.values, theirs.values, 2)
        self.mask = cat_left_padded(self.mask, mask, 1)
        self.next_pos = torch.cat([self.next_pos, pos])
        self.last = torch.cat([self.last, last])
        self.rows = self.slot_rows = self.rows + rows
        if self.prefix is not None and prefix is not None:
            self.prefix = self.prefix.merge(prefix)
        _set_spare(self.cache, self.rows)
        self._resample()

    def _resample(self) -> None:
        self.sampling = BatchSampling.build([r.sampling for r in self.slot_rows], self.vocab, self.device)

    # ---- decoding ---------------------------------------------------------------------------
    def step(self) -> None:
        """Feed every row's last token and sample the next one (or, speculative, verify proposals)."""
        assert self.mask is not None and self.next_pos is not None and self.last is not None
        if self.speculative is not None and self.speculative.step(self):
            return
        n = self.mask.shape[0]  # slots, dead ones included
        self.mask = torch.cat([self.mask, self.mask.new_ones((n, 1))], dim=1)
        self._route(self.slot_rows)
        if self.direct is not None:
            logits = self.direct(
                self.last[:, None], self.mask, self.next_pos[:, None], self.cache, self.prefix
            )
        else:
            logits = self.model(
                input_ids=self.last[:, None],
                attention_mask=self.mask,
                position_ids=self.next_pos[:, None],
                past_key_values=self.cache,
                use_cache=True,
            ).logits[:, -1, :]  # [slots, vocab]
        self.next_pos = self.next_pos + 1
        if self.routers is not None:  # [slots, layers × k]
            routed, at = (
                self.routers.take_rows(),
                self.slots if self.slots is not None else range(len(self.rows)),
            )
            for r, j in zip(self.rows, at, strict=True):
                r.routing.append(routed[j : j + 1])
        assert self.sampling is not None
        tokens, lps = sample(logits, self.sampling, self.next_pos)  # positions of the tokens drawn
        if self.exact:
            lps = exact_step_scores(logits, self.sampling.inv_temp)
        self.last = tokens
        self._record(self.rows, tokens, lps, self.slots)
        if self.speculative is not None:
            self.speculative.plain_done(self)

    def _record(
        self, rows: list[Row], tokens: torch.Tensor, lps: StepScores, slots: list[int] | None = None
    ) -> None:
        """Append sampled tokens (and asked-for log-probs) and mark finished rows.

        tokens: [slots], lps: the step's scores over [slots, vocab]; row i's are at `slots[i]`
        (i when None)."""
        at = slots if slots is not None else range(len(rows))
        toks = tokens.tolist()
        chosen = lps.of(tokens).tolist()
        if any(r.extras for r in rows):
            self._record_extras(rows, lps, at)
        for r, j in zip(rows, at, strict=True):
            tok = toks[j]
            r.output_ids.append(tok)
            r.output_logprobs.append(chosen[j])
            if tok in r.stop_ids or r.stop_strings or len(r.output_ids) >= r.limit:
                self._check_finish(r)

    @staticmethod
    def _record_extras(rows: list[Row], lps: StepScores, at: Any) -> None:
        """Top-k and `token_ids_logprob` pairs of the rows that ask for them."""
        need_top = [i for i, r in enumerate(rows) if r.request.top_logprobs_num > 0]
        if need_top:
            k = max(rows[i].request.top_logprobs_num for i in need_top)
            tops = top_logprobs(lps.rows([at[i] for i in need_top]), k)
            for i, top in zip(need_top, tops, strict=True):
                rows[i].output_top.append(top[: rows[i].request.top_logprobs_num])
        for r, j in zip(rows, at, strict=True):
            if r.request.token_ids_logprob:
                r.output_ids_lp.append(
                    ids_logprobs(lps.rows(slice(j, j + 1)), r.request.token_ids_logprob)[0]
                )

    def _check_finish(self, r: Row) -> None:
        tok = r.output_ids[-1]
        if tok in r.stop_ids:
            r.finish, r.matched = "stop", tok
            return
        stops = r.request.sampling.stop
        if stops and self.tokenizer is not None:
            window = max(len(s) for s in stops) + 8
            tail = self.tokenizer.decode(r.output_ids[-window:], skip_special_tokens=False)
            for s in stops:
                if s in tail:
                    r.finish, r.matched = "stop", s
                    return
        n = len(r.output_ids)
        if n >= r.request.sampling.max_new_tokens or r.prompt_len + n >= r.context_len:
            r.finish = "length"

    def mark_abort(self, match: Any) -> None:
        """Mark rows whose request matches as aborted (kept partial output)."""
        for r in self.rows:
            if r.finish is None and match(r):
                r.finish = "abort"

    DEAD_FRACTION = 0.25
    """Compact the batch tensors once this fraction of their slots belongs to finished rows."""

    def pop_finished(self) -> list[Row]:
        """Remove and return finished rows; their slots go when enough are dead (`_compact`)."""
        done = [r for r in self.rows if r.finish is not None]
        if not done:
            return []
        assert self.mask is not None and self.next_pos is not None and self.last is not None
        at = self.slots if self.slots is not None else list(range(len(self.rows)))
        keep = [(r, j) for r, j in zip(self.rows, at, strict=True) if r.finish is None]
        if not keep:
            self.rows, self.slots, self.cache, self.mask, self.next_pos, self.last, self.sampling = (
                [],
                None,
                None,
                None,
                None,
                None,
                None,
            )
            self.slot_rows, self.prefix = [], None
            return done
        self.rows, self.slots = [r for r, _ in keep], [j for _, j in keep]
        gone = torch.tensor(sorted(set(at) - set(self.slots)), device=self.device)
        self.next_pos[gone] = 0  # a dead slot is fed a harmless position (never past the context)
        if (self.mask.shape[0] - len(self.rows)) >= self.DEAD_FRACTION * self.mask.shape[0]:
            self._compact()
        self._trim()
        return done

    def _compact(self) -> None:
        """Drop the dead slots from the cache and the batch tensors (one copy of the live rows)."""
        if self.slots is None:
            return
        assert self.mask is not None and self.next_pos is not None and self.last is not None
        index = torch.tensor(self.slots, device=self.device)
        self.cache.batch_select_indices(index)
        if self.prefix is not None:
            self.prefix = self.prefix.select(index)
        self.mask = self.mask[index]
        self.next_pos, self.last = self.next_pos[index], self.last[index]
        self.slots = None
        self.slot_rows = self.rows
        self._resample()

    def _trim(self) -> None:
        """Drop leading cache columns that no live row attends to (views: nothing is copied)."""
        assert self.mask is not None
        live_mask = self.mask if self.slots is None else self.mask[self.slots]
        live = live_mask.any(dim=0).nonzero()  # columns some live row still attends to
        first = int(live[0, 0]) if live.numel() else 0
        if first > 0:
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

    def drop_all(self, reason: FinishReason) -> list[Row]:
        """Finish every row with `reason` (after a failed step) and empty the batch."""
        for r in self.rows:
            r.finish = r.finish or reason
        return self.pop_finished()
