"""Loss aggregation: how a per-token loss matrix becomes one scalar.

Every aggregation divides by *global* normalisers (`LossNorm`) that count the whole optimizer
step (all micro-batches, all ranks). Summing the micro-batch losses of one step (gradient
accumulation) therefore equals the loss of the full batch, whatever the micro-batch split:

- ``token_mean``: ``L = Σ_i Σ_t m_it l_it / N_tok`` (every token weighs the same; DAPO, verl's
  ``token-mean``).
- ``seq_mean_token_mean``: ``L = Σ_i (Σ_t m_it l_it / Σ_t m_it) / N_seq`` (every sequence weighs
  the same; original GRPO, verl's ``seq-mean-token-mean``; GSPO's default).
- ``seq_mean_token_sum_norm``: ``L = Σ_i Σ_t m_it l_it / (T_max · N_seq)`` with the constant
  ``T_max`` = the configured max response length (Dr.GRPO: no length bias; verl's
  ``seq-mean-token-sum-norm``).

``N_tok`` is the sum of all loss masks of the step, ``N_seq`` the number of sequences with at
least one loss token. A sequence with no loss tokens adds nothing.

A new aggregation is a function ``(loss [B, T], mask [B, T], norm) -> scalar`` plus one entry in
`AGGREGATIONS`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def _positive(x: float) -> float:
    """A denominator that is never 0 (an empty step gives a zero loss, not NaN)."""
    return x if x > 0 else 1.0


@dataclass(frozen=True, slots=True)
class LossNorm:
    """Global normalisers of one optimizer step, shared by all its micro-batches.

    Build it once per step from every micro-batch's loss mask (`from_masks`), then, with several
    data-parallel ranks, sum it over them (`all_reduced`). Note: FSDP/DDP *average* gradients over
    ranks, so with a world-size-wide `LossNorm` multiply each rank's loss by the world size to
    get the gradient of the global loss.
    """

    num_tokens: float
    """Sum of the loss masks over the whole step (all micro-batches, all ranks)."""
    num_seqs: float
    """Sequences with at least one loss token over the whole step."""
    max_response_len: int
    """Constant length normaliser of ``seq_mean_token_sum_norm`` (the configured max response length)."""

    @staticmethod
    def from_masks(masks: Sequence[Tensor], max_response_len: int) -> LossNorm:
        """Normalisers of the micro-batches ``masks`` (each ``[b, T]``, 0/1), on this rank."""
        num_tokens = 0.0
        num_seqs = 0.0
        for mask in masks:  # [b, T]
            m = mask.detach().to(torch.float64)
            num_tokens += float(m.sum())
            num_seqs += float((m.sum(-1) > 0).sum())
        return LossNorm(num_tokens=num_tokens, num_seqs=num_seqs, max_response_len=int(max_response_len))

    def all_reduced(self, group: object | None = None) -> LossNorm:
        """Sum `num_tokens` / `num_seqs` over the ranks of ``group`` (no-op without torch.distributed)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        device = torch.device("cpu")
        if "nccl" in str(dist.get_backend(group)):
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor([self.num_tokens, self.num_seqs], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=group)
        return LossNorm(num_tokens=float(t[0]), num_seqs=float(t[1]), max_response_len=self.max_response_len)


def token_mean(loss: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    """``Σ m·l / N_tok``. loss, mask: [B, T]."""
    return (loss * mask).sum() / _positive(norm.num_tokens)


def seq_mean_token_mean(loss: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    """``Σ_i (Σ_t m·l / Σ_t m) / N_seq``. loss, mask: [B, T]."""
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1e-8)  # [B]; empty rows: 0 / tiny = 0
    return per_seq.sum() / _positive(norm.num_seqs)


def seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    """``Σ m·l / (T_max · N_seq)`` (Dr.GRPO). loss, mask: [B, T]."""
    return (loss * mask).sum() / (_positive(float(norm.max_response_len)) * _positive(norm.num_seqs))


Aggregation = Callable[[Tensor, Tensor, LossNorm], Tensor]

AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
}
"""Loss aggregations by config name (`AlgorithmConfig.loss_agg`)."""
