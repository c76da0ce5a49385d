"""Mixture-of-experts routing: the recorded expert choices (`RoutedExperts`) and the router hooks
that record them in an engine and replay them in the trainer (`RouterHooks`).

**What is recorded.** For every position of a sequence that a forward ran over as an *input*
(every token but the last: `len(tokens) - 1` rows), each decoder layer's top-k expert ids, in
SGLang's order: row-major `[tokens, layers, k]` (SGLang 0.5.23 returns `meta_info.routed_experts`
as base64 int32 of exactly this shape, for positions `[routed_experts_start_len, seqlen - 1)`).
Row `j` is the routing of the forward at position `j`, the one that predicts token `j + 1`, so the
rows `[P - 1, P + R - 1)` are those that produce the response's log-probs; the prompt rows are
kept too because the prompt's hidden states reach every response token through attention.
Layers without a router (dense layers in a mixed model) and positions nobody recorded (an
observation's tokens in an agentic trajectory) hold -1: "route freely here".

The array travels compactly: uint8 when every id is < 255 (255 stands for -1), else int16. It
is plain bytes, so `Sample` stays JSON-friendly and comparable without numpy or torch.

**Hooks** (torch, loaded only when used): transformers 5's MoE families (Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE, ...) route in a `*TopKRouter` module whose forward returns
`(router_logits [N, E], top_k_weights [N, k], top_k_index [N, k])` over the flattened
`[rows * width]` tokens of the forward. A forward hook on each router records the index
(engine), or replaces the index by the recorded one and recomputes the weights from the current
logits over those experts (trainer: `softmax(logits)` gathered at the recorded ids,
renormalised where the family renormalises), so gradients flow into the router through the
weights exactly as in the un-replayed forward.
"""

from __future__ import annotations

import ast
import base64
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

UNRECORDED = -1
"""An expert id of -1: no recorded choice here; the router picks freely."""

_DTYPES = ("uint8", "int16")
_NPY_CODES = {"<u1": "B", "<i1": "b", "<u2": "H", "<i2": "h", "<i4": "i", "<u4": "I"}
"""`.npy` little-endian integer dtypes → `array` type codes (vLLM sends uint8, uint16 or int32)."""


@dataclass(frozen=True, slots=True)
class RoutedExperts:
    """Recorded top-k expert ids of `tokens` consecutive positions (row-major `[tokens, width]`,
    `width = layers × k`, layer-major within a row: SGLang's `[tokens, layers, k]`)."""

    tokens: int
    """Positions covered (rows)."""
    width: int
    """Ids per row: decoder layers × experts per token."""
    dtype: str
    """Storage: 'uint8' (ids < 255; 255 = -1) or 'int16'."""
    data: bytes = field(repr=False)
    """`tokens * width` ids in `dtype`, native byte order."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"RoutedExperts.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        size = 1 if self.dtype == "uint8" else 2
        if self.tokens < 0 or self.width < 1 or len(self.data) != self.tokens * self.width * size:
            raise ValueError(
                f"RoutedExperts: {len(self.data)} bytes do not hold {self.tokens} × {self.width} {self.dtype}"
            )

    # ---- building -------------------------------------------------------------------------
    @classmethod
    def from_ints(cls, values: Sequence[int], width: int) -> RoutedExperts:
        """From a flat list of ids (row-major, -1 = unrecorded)."""
        if width < 1 or len(values) % width:
            raise ValueError(f"{len(values)} ids do not fill rows of width {width}")
        top = max(values, default=0)
        if top < 255:
            return cls(len(values) // width, width, "uint8", bytes(v & 0xFF for v in values))
        if top > 32767:
            raise ValueError(f"expert id {top} does not fit int16")
        return cls(len(values) // width, width, "int16", array("h", values).tobytes())

    @classmethod
    def unrecorded(cls, tokens: int, width: int) -> RoutedExperts:
        """`tokens` rows of -1 (positions without a recorded choice)."""
        return cls(tokens, width, "uint8", b"\xff" * (tokens * width))

    @classmethod
    def from_tensor(cls, ids: Any) -> RoutedExperts:
        """From an integer tensor `[tokens, layers, k]` (or `[tokens, width]`), -1 = unrecorded."""
        flat = ids.reshape(ids.shape[0], -1)
        return cls.from_ints(flat.reshape(-1).tolist(), int(flat.shape[1]) if flat.numel() else 1)

    def to_ints(self) -> list[int]:
        """The flat ids (row-major), -1 where unrecorded."""
        if self.dtype == "uint8":
            return [UNRECORDED if b == 255 else b for b in self.data]
        return array("h", self.data).tolist()

    def to_tensor(self) -> Any:
        """An int64 tensor `[tokens, width]` (-1 = unrecorded)."""
        import torch

        if not self.tokens:
            return torch.empty((0, self.width), dtype=torch.long)
        if self.dtype == "uint8":
            raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8).long()
            raw[raw == 255] = UNRECORDED
        else:
            raw = torch.frombuffer(bytearray(self.data), dtype=torch.int16).long()
        return raw.reshape(self.tokens, self.width)

    @property
    def nbytes(self) -> int:
        """Bytes held (the memory cost of the recording)."""
        return len(self.data)

    # ---- editing --------------------------------------------------------------------------
    def rows(self, start: int, end: int | None = None) -> RoutedExperts:
        """Rows `[start, end)`."""
        end = self.tokens if end is None else min(end, self.tokens)
        start = max(0, min(start, end))
        size = 1 if self.dtype == "uint8" else 2
        step = self.width * size
        return RoutedExperts(end - start, self.width, self.dtype, self.data[start * step : end * step])

    def concat(self, other: RoutedExperts) -> RoutedExperts:
        """These rows followed by `other`'s (same width; the wider dtype wins)."""
        if other.width != self.width:
            raise ValueError(f"cannot join routing of width {self.width} and {other.width}")
        if self.dtype == other.dtype:
            return RoutedExperts(self.tokens + other.tokens, self.width, self.dtype, self.data + other.data)
        return RoutedExperts.from_ints(self.to_ints() + other.to_ints(), self.width)

    # ---- wire and JSON --------------------------------------------------------------------
    @classmethod
    def from_sglang(cls, b64: str, tokens: int) -> RoutedExperts:
        """SGLang's `meta_info.routed_experts` (base64 of int32 `[tokens, layers, k]`)."""
        ints = array("i")
        ints.frombytes(base64.b64decode(b64))
        if tokens <= 0:
            if len(ints):
                raise ValueError(f"{len(ints)} routed expert ids for 0 positions")
            return cls(0, 1, "uint8", b"")
        if len(ints) % tokens:
            raise ValueError(f"{len(ints)} routed expert ids do not split into {tokens} positions")
        return cls.from_ints(ints.tolist(), len(ints) // tokens)

    @classmethod
    def from_npy(cls, b64: str) -> RoutedExperts:
        """vLLM's `choices[i].routed_experts`: base64 of a `.npy` file holding a C-order array
        `[tokens, layers, k]` of uint8, uint16 or int32 (`numpy2base64`); read without numpy
        (a little-endian host, as every machine vLLM runs on)."""
        raw = base64.b64decode(b64)
        if raw[:6] != b"\x93NUMPY":
            raise ValueError("routed experts are not a .npy array (no NUMPY magic)")
        field_end = 10 if raw[6] == 1 else 12  # header length: uint16 in format 1.0, else uint32
        data_start = field_end + int.from_bytes(raw[8:field_end], "little")
        header = ast.literal_eval(raw[field_end:data_start].decode("latin1"))
        code = _NPY_CODES.get(header["descr"].replace("|", "<"))
        shape = tuple(header["shape"])
        if code is None or header["fortran_order"] or len(shape) != 3:
            raise ValueError(
                f"unexpected routed experts array {header} (want C-order [tokens, layers, k] ints)"
            )
        ints = array(code)
        ints.frombytes(raw[data_start:])
        width = shape[1] * shape[2]
        if len(ints) != shape[0] * width:
            raise ValueError(f"{len(ints)} routed expert ids do not fill the shape {shape}")
        return cls.from_ints(ints.tolist(), width) if shape[0] else cls(0, max(1, width), "uint8", b"")

    def to_sglang(self) -> str:
        """The SGLang wire form: base64 of int32 `[tokens, layers, k]`."""
        return base64.b64encode(array("i", self.to_ints()).tobytes()).decode("ascii")

    def to_json(self) -> dict[str, Any]:
        """A JSON-friendly dict (`from_json` inverts it)."""
        return {
            "tokens": self.tokens,
            "width": self.width,
            "dtype": self.dtype,
            "data": base64.b64encode(self.data).decode("ascii"),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoutedExperts:
        """Inverse of `to_json`."""
        return cls(
            int(data["tokens"]), int(data["width"]), str(data["dtype"]), base64.b64decode(data["data"])
        )


def extend_routing(
    current: RoutedExperts | None, new: RoutedExperts | None, start: int, covered: int
) -> RoutedExperts | None:
    """A sequence's routing after an engine call: `current` covers positions `[0, E)`; `new`
    (the call's) covers `[start, ...)`. Rows already recorded are kept; the call's rows past them
    are appended. None when they cannot be joined (a gap, or a call without routing), so a
    trajectory never carries routing that is misaligned with its tokens. `covered` is E (0 when
    `current` is None)."""
    if new is None:
        return None
    if current is None:
        return new if start == 0 else None
    if start > covered or new.width != current.width:
        return None
    return current.concat(new.rows(covered - start))


# ---------------------------------------------------------------------------- torch hooks

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


ROUTER_CLASSES = frozenset(
    {"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter", "OlmoeTopKRouter"}
)
"""Router classes whose forward returns `(router_logits, top_k_weights, top_k_index)`, the shape
the hooks read. Other families' routers return other tuples (GraniteMoE: index first), so their
models are treated as not recordable rather than misread."""

RECORDABLE_MODEL_TYPES = frozenset({"qwen3_moe", "qwen2_moe", "mixtral", "olmoe"})
"""`config.json` `model_type`s whose routers are `ROUTER_CLASSES`: the MoE families verst records
and replays. Another MoE family (GraniteMoE, ...) is refused at config validation by name."""


def find_routers(model: Any) -> list[tuple[int, Any]]:
    """`(decoder layer index, router module)` of every supported MoE router (`ROUTER_CLASSES`);
    empty for a dense model or an unsupported MoE family."""
    out = []
    for name, module in model.named_modules():
        if type(module).__name__ in ROUTER_CLASSES and hasattr(module, "top_k"):
            found = _LAYER.search(name + ".")
            if found is not None:
                out.append((int(found.group(1)), module))
    return out


def moe_spec(config: Any) -> tuple[int, int, int] | None:
    """`(decoder layers, experts per token, experts)` of an MoE config; None for a dense one."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    k = getattr(cfg, "num_experts_per_tok", None)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if not k or not experts:
        return None
    return int(cfg.num_hidden_layers), int(k), int(experts)


class RouterHooks:
    """Forward hooks on a model's MoE routers: record what each forward chose, optionally replay
    given choices (see the module doc). One instance per model; `close` removes the hooks.

    Per forward: set `replay` (int64 `[N, layers, k]` over the forward's flattened tokens, -1 =
    free) or None before it; after it, `chosen()` is what the routers used `[N, layers, k]`,
    `free_choice()` what they would have chosen without replay, and `logits` the router logits
    per layer (kept only with `keep_logits`, for the load-balancing loss and metrics)."""

    def __init__(self, model: Any, *, keep_logits: bool = False) -> None:
        spec = moe_spec(model.config)
        routers = find_routers(model)
        if spec is None or not routers:
            raise ValueError("the model has no MoE routers (a dense model): nothing to record or replay")
        self.layers, self.k, self.num_experts = spec
        self.keep_logits = keep_logits
        self.replay: Any = None
        """int64 `[N, layers, k]` for the next forward(s), or None (route freely)."""
        self.record = True
        """Keep each forward's choices (`chosen`, `free_choice`)."""
        self.router_layers = sorted(layer for layer, _ in routers)
        self._chosen: dict[int, Any] = {}
        self._free: dict[int, Any] = {}
        self.logits: dict[int, Any] = {}
        """Router logits `[N, experts]` of the last forward, per layer (with `keep_logits`)."""
        self._handles = [r.register_forward_hook(self._hook(layer)) for layer, r in routers]

    @classmethod
    def of(cls, model: Any, **kwargs: Any) -> RouterHooks | None:
        """Hooks on `model`'s routers; None for a dense model."""
        return cls(model, **kwargs) if moe_spec(model.config) and find_routers(model) else None

    def take_rows(self) -> Any:
        """The last forward's choices as compact CPU rows `[tokens, layers × k]` (int16), then
        forget them (what an engine keeps per request)."""
        import torch

        chosen = self.chosen()  # [tokens, layers, k]
        self.clear()
        return chosen.reshape(chosen.shape[0], -1).to("cpu", torch.int16)

    def _hook(self, layer: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> Any:
            return self._on_router(layer, module, output)

        return hook

    def _on_router(self, layer: int, module: Any, output: Any) -> Any:
        import torch

        logits, weights, index = output
        if self.keep_logits:
            self.logits[layer] = logits
        replay = self.replay
        if self.record:
            self._free[layer] = index.detach()
        if replay is None:
            if self.record:
                self._chosen[layer] = index.detach()
            return None
        rec = replay[:, layer].to(index.device)  # [N, k]
        if rec.shape != index.shape:
            raise ValueError(
                f"replayed routing {tuple(rec.shape)} does not match the router's {tuple(index.shape)}"
            )
        free = (rec < 0).any(-1, keepdim=True)  # [N, 1]
        chosen = torch.where(free, index, rec)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # the routers' own formula
        top = probs.gather(-1, chosen)
        if getattr(module, "norm_topk_prob", True):  # Mixtral always renormalises
            top = top / top.sum(dim=-1, keepdim=True)
        if self.record:
            self._chosen[layer] = chosen.detach()
        return logits, top.to(weights.dtype), chosen

    def _stack(self, per_layer: dict[int, Any]) -> Any:
        import torch

        if not per_layer:
            return None
        some = next(iter(per_layer.values()))
        out = torch.full(
            (some.shape[0], self.layers, self.k), UNRECORDED, dtype=torch.long, device=some.device
        )
        for layer, ids in per_layer.items():
            out[:, layer] = ids
        return out

    def chosen(self) -> Any:
        """The experts the last forward used, int64 `[N, layers, k]` (-1 for dense layers)."""
        return self._stack(self._chosen)

    def free_choice(self) -> Any:
        """The experts the last forward's routers picked themselves (before replay)."""
        return self._stack(self._free)

    def clear(self) -> None:
        """Forget the last forward's records (and logits)."""
        self._chosen, self._free, self.logits = {}, {}, {}

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
