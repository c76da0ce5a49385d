"""Per-token log-probs (and entropy) of response tokens, from hidden states and the LM head.

The model runs only its decoder (`get_decoder()`); the hidden states at the positions that
predict response tokens are gathered into `[num_response_tokens, hidden]` and go through
`verst.kernels.linear_token_logprobs` with the LM-head weight, in chunks, so the full
`[tokens, vocab]` logits never exist (forward and backward). What the model's own forward does
after the head (a logit scale, a soft-cap, a bias: `verst.trainer.train.logit_head`) is applied on
every path, so the logits are the ones the engine samples from. Temperature is the rollout's:
the engine reports `log_softmax(logits / T)` of each sampled token, so the trainer does the same.

A micro-batch arrives in one of the layouts of `verst.trainer.train.layout` (right-padded rows, one
packed row, or one row per shared prompt with a 4D mask); all give the same log-probs (tested
against the right-padded layout). A shared-prompt micro-batch also carries its `RowPieces`: on a
model switched to `verst.trainer.train.pieces.pieces_sdpa` they go to every attention call, which
then scores only the pairs the rows need instead of the dense mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from verst.trainer.train.layout import LAYOUTS, DecoderShape, PackedInputs, additive_mask
from verst.trainer.train.logit_head import LogitHead, logit_head
from verst.trainer.train.pieces import MIN_SAVED_MACS, uses_pieces_attention

__all__ = ["PackedInputs", "PolicyLogprobs", "hidden_logprobs", "pack_sequences", "unflatten"]


def pack_sequences(
    tokens: Sequence[Sequence[int]],
    response_lengths: Sequence[int],
    *,
    packing: bool | None = None,
    layout: str | None = None,
    pad_id: int = 0,
) -> PackedInputs:
    """Lay out sequences (prompt + response ids) for one forward pass (`verst.trainer.train.layout`).

    `layout` names the layout ('padded', 'packed', 'shared_prompt'); `packing=True/False` is the
    older spelling of 'packed'/'padded'. Position `p` predicts token `p + 1`, so a sequence of
    length L with R response tokens needs the hidden states at positions `L-R-1 .. L-2`.
    """
    if layout is None:
        if packing is None:
            raise TypeError("pack_sequences needs layout= (or packing=)")
        layout = "packed" if packing else "padded"
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return LAYOUTS[layout].build(tokens, response_lengths, pad_id=pad_id)


def unflatten(flat: torch.Tensor, response_lengths: Sequence[int], width: int) -> torch.Tensor:
    """`[sum(R)]` → right-padded `[num_seqs, width]` (zeros past each response)."""
    if response_lengths and max(response_lengths) > width:
        raise ValueError(f"a response of {max(response_lengths)} tokens does not fit width {width}")
    lengths = torch.tensor(list(response_lengths), dtype=torch.long, device=flat.device)  # [num_seqs]
    keep = torch.arange(width, device=flat.device)[None, :] < lengths[:, None]  # [num_seqs, width]
    out = flat.new_zeros((len(response_lengths), width))
    return out.masked_scatter(keep, flat[: int(lengths.sum())])


DIRECT_MAX_LOGITS = 1 << 20
"""`backend='auto'` computes log-probs without chunking when `N * V` is at most this (4 MiB float32)."""


def hidden_logprobs(
    hidden: torch.Tensor,  # [N, H]
    head: LogitHead | torch.Tensor,  # or a bare LM-head weight [V, H]
    target_ids: torch.Tensor,  # [N]
    *,
    temperature: float,
    return_entropy: bool,
    backend: str = "auto",
    chunk_size: int = 256,
    keep_logits_mib: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs `[N]` (and entropy `[N]`) of `target_ids` under `softmax(head(hidden) / T)`.

    `auto` computes small problems (`N * V <= DIRECT_MAX_LOGITS`, e.g. a tiny vocabulary) with
    one direct matmul: their full logits are smaller than one chunk of a real vocabulary, and
    the chunked kernel's per-chunk work would cost more than it saves. `keep_logits_mib`: the
    chunked kernel keeps the forward's logits for the backward when they fit in this many MiB
    (None = the kernels' default, `verst.kernels.KEEP_LOGITS_MAX_BYTES`; 0 = always recompute).
    """
    if isinstance(head, torch.Tensor):
        head = LogitHead(weight=head)
    if backend == "exact":  # train.exact_on_policy: the engine's ops, bit for bit
        return _exact_logprobs(hidden, head, target_ids, temperature, return_entropy)
    direct = backend == "auto" and hidden.shape[0] * head.weight.shape[0] <= DIRECT_MAX_LOGITS
    if backend == "naive" or direct:
        logp = torch.log_softmax(head.logits(hidden) / temperature, dim=-1)  # [N, V]
        lp = logp.gather(-1, target_ids[:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1) if return_entropy else None
        if direct:  # clones: see below (FSDP2 and views)
            return lp.clone(), (ent.clone() if ent is not None else None)
        return lp, ent
    from verst.kernels import linear_token_logprobs

    kwargs: dict[str, Any] = {} if backend == "auto" else {"backend": backend}
    if keep_logits_mib is not None:
        kwargs["keep_logits_max_bytes"] = int(keep_logits_mib * 2**20)
    out = linear_token_logprobs(
        hidden,
        target_ids=target_ids,
        return_entropy=return_entropy,
        chunk_size=chunk_size,
        **head.kernel_args(temperature),
        **kwargs,
    )
    # clones: FSDP2 warns about (and mishandles in-place ops on) views returned from its root
    if return_entropy:
        return out[0].clone(), out[1].clone()
    return (out[0] if isinstance(out, tuple) else out).clone(), None


def _exact_logprobs(
    hidden: torch.Tensor, head: LogitHead, target_ids: torch.Tensor, temperature: float, return_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`exact_logprobs(exact_linear(hidden, W) * (1/T))`: what the exactly on-policy engine
    reports (`verst.trainer.train.exact_head`: chunked, with an analytic backward)."""
    from verst.trainer.train.exact_head import exact_head_logprobs

    if head.scale != 1.0 or head.softcap is not None:
        raise ValueError("exact_on_policy: an LM head with a logit scale or soft-cap is not covered")
    lp, ent = exact_head_logprobs(hidden, head.weight, head.bias, target_ids, temperature)
    return lp, (ent if return_entropy else None)


class PolicyLogprobs(nn.Module):
    """Wraps a Hugging Face causal LM so one `forward` returns response-token log-probs.

    Being a module matters for FSDP2: the wrapper is the root unit, so its forward all-gathers
    the embeddings, final norm and LM head (decoder layers are their own units) and the LM-head
    weight used by the chunked kernel is the full one, with gradients reduce-scattered after.
    """

    def __init__(
        self,
        policy: nn.Module,
        *,
        backend: str = "auto",
        chunk_size: int = 256,
        compute_dtype: torch.dtype | None = None,
        pieces_min_saved: int = MIN_SAVED_MACS,
        keep_logits_mib: float | None = None,
    ) -> None:
        """`compute_dtype`: cast the hidden states and the LM-head weight to it for the log-prob
        kernels (fp32 masters, bf16 compute; the cast is differentiable). None = as they are.
        `pieces_min_saved`: on the pieces attention, what a shared-prompt micro-batch must save
        to use it (`verst.trainer.train.pieces.worth_pieces`). `keep_logits_mib`: see
        `hidden_logprobs` (`train.logprob_keep_logits_mib`)."""
        super().__init__()
        self.policy = policy
        self.backend = backend
        self.chunk_size = chunk_size
        self.compute_dtype = compute_dtype
        self.pieces_min_saved = pieces_min_saved
        self.keep_logits_mib = keep_logits_mib

    @property
    def _pieces_width(self) -> int:
        """The attention width (heads × head dim) when the policy runs the pieces attention, else 0."""
        if not uses_pieces_attention(self.policy):
            return 0
        return DecoderShape.from_config(self.policy.config).attn_width

    def _decoder_inputs(self, inputs: PackedInputs) -> dict[str, Any]:
        """The decoder's keyword arguments for `inputs`: ids (or a vision batch's embeddings),
        positions, the mask (a shared-prompt bool mask made additive, what SDPA and eager take)
        and, where the pieces attention runs them, the shared-prompt pieces."""
        param = next(self.policy.parameters())
        device = param.device
        mask = None if inputs.attention_mask is None else inputs.attention_mask.to(device)
        if mask is not None and mask.dim() == 4:  # shared prompt: bool -> additive (SDPA and eager)
            mask = additive_mask(mask, param.dtype if param.dtype.is_floating_point else torch.float32)
        ids = inputs.input_ids.to(device)
        kwargs: dict[str, Any] = (
            {"input_ids": ids}
            if inputs.vision is None
            else {"inputs_embeds": inputs.vision.embeds(self.policy, ids)}
        )
        pieces, width = inputs.pieces, self._pieces_width
        if pieces is not None and pieces.flat and not width:
            raise ValueError("a flat shared-prompt row needs the policy on the pieces attention (`pieces`)")
        if width and pieces is not None and pieces.worth_it(width, self.pieces_min_saved):
            kwargs["shared_pieces"] = pieces.to(device)  # attention over the pieces, not the mask
        return {**kwargs, "position_ids": inputs.position_ids.to(device), "attention_mask": mask}

    def forward(
        self,
        inputs: PackedInputs,
        *,
        temperature: float = 1.0,
        return_entropy: bool = False,
        hidden_fn: Callable[[torch.Tensor, LogitHead], Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, Any]:
        """Flat log-probs `[num_response_tokens]` (and entropy) for a packed/padded micro-batch.

        `hidden_fn(hidden [N, H], head)`, when given, runs inside this forward (so under FSDP2 on
        the gathered weight) and its result is returned third — used by on-policy distillation
        for top-k log-probs through the chunked kernels (`head.kernel_args(T)`).
        """
        device = next(self.policy.parameters()).device
        out = self.policy.get_decoder()(**self._decoder_inputs(inputs), use_cache=False)
        hidden = out.last_hidden_state  # [rows, width, H]
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, inputs.gather_index.to(device))
        head = logit_head(self.policy)  # read per forward: under FSDP2 the gathered weight
        if self.compute_dtype is not None:  # bf16 compute from the fp32 masters (differentiable casts)
            dt = self.compute_dtype
            bias = None if head.bias is None else head.bias.to(dt)
            hidden, head = hidden.to(dt), dataclasses.replace(head, weight=head.weight.to(dt), bias=bias)
        lp, ent = hidden_logprobs(
            hidden,
            head,
            inputs.target_ids.to(device),
            temperature=temperature if temperature > 0 else 1.0,
            return_entropy=return_entropy,
            backend=self.backend,
            chunk_size=self.chunk_size,
            keep_logits_mib=self.keep_logits_mib,
        )
        if hidden_fn is None:
            return lp, ent
        return lp, ent, hidden_fn(hidden, head)
