"""The chunked linear path's logits `post(h @ W.T + b)`, one `[rows, cols]` tile at a time.

`TileLogits` owns the buffers they live in: one buffer reused by every tile (CPU allocations of
that size are fresh pages each time), or, when the forward keeps them for the backward, one
`[N, V]` array. A tile is `rows` tokens by `cols` vocabulary entries: the whole vocabulary on
the Triton path (token chunks), a slice of it on the torch path (`verst.kernels._tiles`).
"""

from __future__ import annotations

from typing import Protocol

import torch


class _UsesWorkspace(Protocol):
    uses_workspace: bool


def no_autocast(t: torch.Tensor) -> torch.autocast:
    """The tile matmuls run in the inputs' dtype: under an ambient autocast the forward would be
    cast while the backward's recompute would not, and the two would disagree."""
    return torch.autocast(device_type=t.device.type, enabled=False)


class TileLogits:
    """Each tile's logits `post(h[s:e] @ W[v0:v1].T + b[v0:v1])`; `post` is the optional soft-cap
    `cap * tanh(x / cap)`. The forward and the backward's recompute run the same matmul on the
    same tile, so they see bit-identical logits; kept logits (`kept`, the forward's pre-soft-cap
    logits, never written by a backward) are those bits too."""

    def __init__(
        self,
        hidden: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V, H]
        bias: torch.Tensor | None,  # [V]
        softcap: float | None,
        size: int,  # elements of the largest tile
        kept: torch.Tensor | None = None,  # [N, V] pre-soft-cap logits kept by the forward
    ) -> None:
        self.hidden, self.weight, self.bias, self.softcap = hidden, weight, bias, softcap
        self.size, self.kept = size, kept
        self._buf: torch.Tensor | None = None  # [size], the weight's dtype
        self._f32: torch.Tensor | None = None  # [size] float32, the torch row ops' workspace

    def _raw(self, s: int, e: int, v0: int, v1: int, into: torch.Tensor) -> torch.Tensor:
        with no_autocast(self.hidden):  # the inputs' dtype, forward and recompute alike
            torch.mm(self.hidden[s:e], self.weight[v0:v1].T, out=into)  # [rows, cols]
            if self.bias is not None:
                into += self.bias[v0:v1]
        return into

    def _buffer(self, rows: int, cols: int) -> torch.Tensor:
        if self._buf is None:
            self._buf = self.weight.new_empty(self.size)
        return self._buf[: rows * cols].view(rows, cols)

    def compute(
        self, s: int, e: int, v0: int, v1: int, *, keep: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """(logits [rows, cols], `tanh(x / cap)` float32 or None, whether the logits are a
        temporary the row ops may overwrite). `keep` (forward only) writes them into the kept
        array: directly for whole rows, else through the tile buffer (the recompute's matmul)."""
        if keep and self.kept is not None and v1 - v0 == self.weight.shape[0]:
            raw, own = self._raw(s, e, v0, v1, self.kept[s:e]), False
        elif keep and self.kept is not None:
            raw, own = self._raw(s, e, v0, v1, self._buffer(e - s, v1 - v0)), True
            self.kept[s:e, v0:v1] = raw
        elif self.kept is not None:  # backward of a keeping forward: read, never write
            raw, own = self.kept[s:e, v0:v1], False
        else:
            raw, own = self._raw(s, e, v0, v1, self._buffer(e - s, v1 - v0)), True
        if self.softcap is None:
            return raw, None, own
        x = raw.float()  # [rows, cols]; the same tensor when raw is float32
        t = (x.div_(self.softcap) if own or x is not raw else torch.div(x, self.softcap)).tanh_()
        return t * self.softcap, t, True

    def workspace(self, ops: _UsesWorkspace, logits: torch.Tensor, overwrite: bool) -> torch.Tensor | None:
        """The float32 buffer the torch row ops write into when they may not overwrite the logits."""
        if not ops.uses_workspace or (overwrite and logits.dtype == torch.float32):
            return None
        if self._f32 is None:
            self._f32 = torch.empty(self.size, dtype=torch.float32, device=logits.device)
        return self._f32[: logits.numel()].view(logits.shape)
