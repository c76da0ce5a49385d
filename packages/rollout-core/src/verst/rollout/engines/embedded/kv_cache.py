"""The embedded engine's KV cache: transformers' `DynamicCache` whose layers grow in place.

transformers' `DynamicLayer.update` concatenates, copying the whole cache every decode step.
`growing_cache` swaps each full-attention layer for a subclass that keeps `keys`/`values` as
column views of a buffer with spare columns, so a decode step writes one column and copies
nothing (`embedded.batch` sizes the spare room to what its rows can still generate).
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def growing_cache(config: Any) -> Any:
    """A `DynamicCache` whose full-attention layers grow in place (see `_growing_layer_class`)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    other = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if other:
        raise ValueError(
            f"the embedded engine supports full-attention KV caches only; this model's cache has {other} "
            f"layers (sliding-window or linear attention); serve it with SGLang (engine.type = 'sglang')"
        )
    layer_cls = _growing_layer_class()
    cache.layers = [layer_cls() for _ in cache.layers]
    return cache


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """`t` with `n` zero entries (masked columns) before its own along `dim`."""
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def cat_left_padded(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """`a`'s rows then `b`'s (dim 0), each left-padded with zeros (masked columns) along `dim`
    to the wider of the two: two batches' caches or masks joined."""
    width = max(a.shape[dim], b.shape[dim])
    return torch.cat([_pad_left(a, width - a.shape[dim], dim), _pad_left(b, width - b.shape[dim], dim)])


def _with_capacity(x: torch.Tensor, cap: int) -> torch.Tensor:
    """A `[batch, heads, cap, head_dim]` buffer holding `x` in its first columns."""
    buf = x.new_empty((*x.shape[:2], cap, x.shape[-1]))
    buf[:, :, : x.shape[2]] = x
    return buf


def stack_caches(caches: list[Any], rows: list[torch.Tensor], total: int, width: int) -> Any:
    """One growing cache of `total` rows from `caches` (each left-padded to its own width): cache
    i's rows become rows `rows[i]`, right-aligned at `width`, zeros (masked) to the left of a
    narrower one's columns. One copy into each layer's buffer, with the spare room (`spare`) of
    the first cache's layers. Returns the first cache, now holding every row."""
    out = caches[0]
    for i, layer in enumerate(out.layers):
        spare = max(1, min(layer.spare, layer.CHUNK))
        layer._kbuf = _stacked([c.layers[i].keys for c in caches], rows, total, width, spare)
        layer._vbuf = _stacked([c.layers[i].values for c in caches], rows, total, width, spare)
        layer.keys, layer.values = layer._kbuf[:, :, :width], layer._vbuf[:, :, :width]
    return out


def _stacked(
    parts: list[torch.Tensor], rows: list[torch.Tensor], total: int, width: int, spare: int
) -> torch.Tensor:
    """`[total, heads, width + spare, head_dim]` with `parts[i]` (`[n_i, heads, w_i, head_dim]`)
    in rows `rows[i]`, right-aligned at `width`, zeros to their left, the spare columns unset."""
    first = parts[0]
    buf = first.new_empty((total, first.shape[1], width + spare, first.shape[3]))
    for part, index in zip(parts, rows, strict=True):
        pad = width - part.shape[2]
        buf[:, :, :pad].index_fill_(0, index, 0)
        buf[:, :, pad:width].index_copy_(0, index, part)
    return buf


def _view_start(k: Any, v: Any, kb: Any, vb: Any) -> int | None:
    """The column of buffers `kb`/`vb` where `k`/`v` start, when they are column views of them
    (else None: the tensors were replaced, e.g. by a merge, and must be re-adopted)."""
    if kb is None or vb is None or k is None or v is None:
        return None
    if k.shape[:2] != kb.shape[:2] or v.shape[:2] != vb.shape[:2]:
        return None
    if k.stride() != kb.stride() or v.stride() != vb.stride():
        return None
    # a view's offset into a buffer we still hold can only come from slicing that buffer
    dk = (k.data_ptr() - kb.data_ptr()) // k.element_size()
    dv = (v.data_ptr() - vb.data_ptr()) // v.element_size()
    if dk < 0 or dk % kb.stride(2) or dv < 0 or dv % vb.stride(2):
        return None
    start = dk // kb.stride(2)
    if start != dv // vb.stride(2) or start + k.shape[2] > kb.shape[2]:
        return None
    return start


def _layer_start(layer: Any) -> int | None:
    """`_view_start` of a growing layer, read off what it remembers (`_seen`) while its keys,
    values and buffers are the very objects it last left (a decode step's common case: four
    identity checks instead of the strides and pointers)."""
    seen, k, v, kb, vb = layer._seen, layer.keys, layer.values, layer._kbuf, layer._vbuf
    if seen is not None and seen[0] is k and seen[1] is v and seen[2] is kb and seen[3] is vb:
        return seen[4]
    return _view_start(k, v, kb, vb)


def _select_rows(layer: Any, indices: torch.Tensor) -> None:
    """A growing layer's `batch_select_indices`: keep the `indices` rows, one copy of their live
    columns plus the spare room. A 4-D cache with no columns yet (a split batch's own-token cache
    before its first step, `embedded.shared_prefix`) still selects its rows, which transformers'
    `DynamicLayer` would skip."""
    start, keys = layer._start(), layer.keys
    if start is None or keys.numel() == 0:
        if keys is not None and keys.dim() == 4:
            layer.keys, layer.values = keys[indices], layer.values[indices]
        return
    t = keys.shape[-2]
    layer._kbuf = layer._kbuf[:, :, start:].index_select(0, indices)
    layer._vbuf = layer._vbuf[:, :, start:].index_select(0, indices)
    layer.keys, layer.values = layer._kbuf[:, :, :t], layer._vbuf[:, :, :t]


@functools.cache
def _growing_layer_class() -> type:
    """`DynamicLayer` that writes each step's keys/values into spare capacity.

    transformers' `DynamicLayer.update` concatenates, copying the whole cache every decode step;
    this subclass keeps `keys`/`values` as column views of a buffer with spare columns (`spare`,
    set by the batch to what its rows can still generate, at most `CHUNK`). Row selection
    (finished rows leaving) selects from the buffer, keeping the spare room; trimming leading
    columns keeps the view. Whenever the batch replaces the tensors otherwise (merge), the next
    update sees they are no longer views of the buffer and re-adopts them.
    """
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        CHUNK = 64
        spare = CHUNK
        """Spare columns allocated past the current length (the batch lowers it to what it needs)."""
        _kbuf: torch.Tensor | None = None
        _vbuf: torch.Tensor | None = None
        _seen: tuple[Any, ...] | None = None  # (keys, values, key buffer, value buffer, start) as last left

        def _adopt(self, keys: torch.Tensor, values: torch.Tensor, extra: int) -> None:
            t = keys.shape[2]
            cap = t + extra + max(1, min(self.spare, self.CHUNK))
            self._kbuf, self._vbuf = _with_capacity(keys, cap), _with_capacity(values, cap)
            self.keys, self.values = self._kbuf[:, :, :t], self._vbuf[:, :, :t]

        def _start(self) -> int | None:  # where keys/values start in the buffers (None: not views of them)
            return _layer_start(self)

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self.keys is None or self.keys.numel() == 0:
                self._adopt(key_states, value_states, 0)
                return self.keys, self.values
            t, n = self.keys.shape[-2], key_states.shape[-2]
            start = self._start()
            if start is None or start + t + n > self._kbuf.shape[-2]:
                self._adopt(self.keys, self.values, n)
                start = 0
            self._kbuf.narrow(2, start + t, n).copy_(key_states)
            self._vbuf.narrow(2, start + t, n).copy_(value_states)
            self.keys, self.values = self._kbuf.narrow(2, start, t + n), self._vbuf.narrow(2, start, t + n)
            self._seen = (self.keys, self.values, self._kbuf, self._vbuf, start)
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            _select_rows(self, indices)

    return GrowingLayer
