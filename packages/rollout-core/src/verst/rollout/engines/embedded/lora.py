"""LoRA adapters in the embedded engine: the base weights once, any number of adapters on top.

An adapter is what PEFT saves (`adapter_config.json` + `adapter_model.safetensors`, tensor names
`base_model.model.<module>.lora_A.weight` / `.lora_B.weight`) — the format SGLang's
`/load_lora_adapter` reads, and what the trainer sends in-process. `EngineAdapters` keeps every
loaded adapter stacked per target module (slot 0 = no adapter, all zeros; smaller ranks are
zero-padded, which adds exactly nothing) and adds `x @ A[slot]ᵀ @ (scale · B[slot])ᵀ` to each
target linear's output through a forward hook, so module names and full-weight refits are
unchanged. Before every forward the decode batch names each row's adapter (`select`), so rows
with different adapters — and rows without one — decode in one batch (multi-LoRA).

`LoraEngineMixin` gives `EmbeddedEngine` SGLang's LoRA surface: `load_lora_adapter` (from a
PEFT directory), `load_lora_adapter_from_tensors`, `unload_lora_adapter`, applied between decode
steps. Loading a name that is already loaded replaces it (the engine's refit); `verst serve`
keeps SGLang's stricter HTTP rule (unload first). `weight_version` (optional) sets the engine's
version in the same step, so an adapter refit is version-checked like a full one.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.common.lora import AdapterFiles, AdapterLoading, AdapterSource

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
"""PEFT adapter tensor names: `base_model.model.<module>.lora_A.weight` (an adapter-name segment
such as `.default` before `.weight` is accepted too)."""


@dataclass(slots=True)
class Adapter:
    """One adapter, parsed: per target module its A `[r, in]` and scaled B `[out, r]`."""

    name: str
    """The name requests use (`lora_path` on the wire)."""
    path: str
    """Where it was loaded from ('__tensor__' for in-process tensors, as SGLang records it)."""
    rank: int
    """LoRA rank r."""
    weights: dict[str, tuple[Any, Any]]
    """module path → (A `[r, in]`, B `[out, r]`) as saved (before the scale: `train.exact_on_policy`
    computes `B(A(x)) * scale` in PEFT's order, not `x @ Aᵀ @ (scale · B)ᵀ`, other roundings)."""
    scale: float
    """alpha / r (or alpha / sqrt(r) with rsLoRA): PEFT's `scaling`."""

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors."""
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values()
        )


def parse_adapter(name: str, tensors: dict[str, Any], config: dict[str, Any], *, path: str) -> Adapter:
    """PEFT tensors + adapter config → `Adapter`; a clear `InvalidRequest` on anything else."""
    import math

    rank = config.get("r")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(rank, int) or rank <= 0:
        raise InvalidRequest(f"LoRA adapter {name!r}: adapter config needs an integer r > 0, got {rank!r}")
    scale = float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    halves: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise InvalidRequest(
                f"LoRA adapter {name!r}: unexpected tensor {key!r} (only lora_A/lora_B weights of linear "
                "layers are supported; no DoRA, no embedding or bias adapters)"
            )
        halves.setdefault(m["module"], {})[m["ab"]] = t
    weights = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise InvalidRequest(f"LoRA adapter {name!r}: module {module!r} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise InvalidRequest(
                f"LoRA adapter {name!r}: {module!r} has A {tuple(a.shape)}, B {tuple(b.shape)}; "
                f"expected A [r={rank}, in] and B [out, r={rank}]"
            )
        weights[module] = (a.detach(), b.detach())
    if not weights:
        raise InvalidRequest(f"LoRA adapter {name!r} has no lora_A/lora_B tensors")
    return Adapter(name, path, rank, weights, scale)


def read_adapter_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, adapter config) of a PEFT adapter directory."""
    path = Path(path)
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise InvalidRequest(f"{str(path)!r} is not a PEFT adapter directory (no adapter_config.json)")
    config = json.loads(cfg_file.read_text())
    st = path / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st)), config
    binary = path / "adapter_model.bin"
    if binary.is_file():
        import torch

        return torch.load(binary, map_location="cpu", weights_only=True), config
    raise InvalidRequest(f"{str(path)!r} has no adapter_model.safetensors (or .bin)")


class EngineAdapters:
    """The adapters loaded in one model, applied per row through forward hooks."""

    def __init__(
        self, model: Any, *, max_rank: int | None = None, target_modules: list[str] | None = None
    ) -> None:
        """`max_rank` / `target_modules` (optional limits, like SGLang's `--max-lora-rank` and
        `--lora-target-modules`) make adapters beyond them an error."""
        import torch

        self.model = model
        self.max_rank = max_rank
        self.target_modules = list(target_modules) if target_modules else None
        self.adapters: dict[str, Adapter] = {}
        """Loaded adapters by name, in load order (slot = position + 1)."""
        self._linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self._stacks: dict[str, tuple[Any, Any]] = {}  # module → (A [S, r, in], B [S, out, r])
        self._exact: dict[str, dict[int, tuple[Any, Any, float]]] = {}  # module → slot → (A, B, scale)
        self._hooks: dict[str, Any] = {}
        self._slots: Any = None  # [batch] long, or None: no row uses an adapter
        self._single: int | None = None  # every row uses this one slot
        self._slot_of: dict[str, int] = {}

    # ---- loading ---------------------------------------------------------------------------
    def check(self, adapter: Adapter) -> None:
        """Refuse an adapter this model (or the configured limits) cannot apply."""
        if self.max_rank is not None and adapter.rank > self.max_rank:
            raise InvalidRequest(
                f"LoRA adapter {adapter.name!r} has rank {adapter.rank} > --max-lora-rank {self.max_rank}"
            )
        for module, (a, b) in adapter.weights.items():
            lin = self._linears.get(module)
            if lin is None:
                raise InvalidRequest(
                    f"LoRA adapter {adapter.name!r} targets {module!r}, which is not a linear layer of "
                    "this model (was it trained for another base model?)"
                )
            if a.shape[1] != lin.in_features or b.shape[0] != lin.out_features:
                raise InvalidRequest(
                    f"LoRA adapter {adapter.name!r}: {module!r} is {lin.in_features}→{lin.out_features}, "
                    f"the adapter is {a.shape[1]}→{b.shape[0]}"
                )
            short = module.rsplit(".", 1)[-1]
            if self.target_modules is not None and short not in self.target_modules:
                raise InvalidRequest(
                    f"LoRA adapter {adapter.name!r} targets {short!r}, not in --lora-target-modules "
                    f"{self.target_modules}"
                )

    def put(self, adapter: Adapter) -> None:
        """Load (or replace) an adapter; call between forwards."""
        self.check(adapter)
        self.adapters[adapter.name] = adapter
        self._rebuild()

    def remove(self, name: str) -> None:
        """Unload an adapter; call between forwards."""
        if name not in self.adapters:
            raise InvalidRequest(f"LoRA adapter {name!r} is not loaded; loaded: {sorted(self.adapters)}")
        del self.adapters[name]
        self._rebuild()

    def _rebuild(self) -> None:
        names = list(self.adapters)
        modules = sorted({m for a in self.adapters.values() for m in a.weights})
        rmax = max((a.rank for a in self.adapters.values()), default=0)
        stacks, exact = {}, {}
        for module in modules:
            lin = self._linears[module]
            w = lin.weight
            a_stack = w.new_zeros((len(names) + 1, rmax, lin.in_features))  # [S, r, in]
            b_stack = w.new_zeros((len(names) + 1, lin.out_features, rmax))  # [S, out, r]
            exact[module] = {}
            for slot, name in enumerate(names, start=1):
                adapter = self.adapters[name]
                pair = adapter.weights.get(module)
                if pair is not None:
                    a, b = pair
                    a_stack[slot, : a.shape[0]] = a.to(w.device, w.dtype)
                    b_stack[slot, :, : b.shape[1]] = (b * adapter.scale).to(w.device, w.dtype)
                    exact[module][slot] = (a.to(w.device, w.dtype), b.to(w.device, w.dtype), adapter.scale)
            stacks[module] = (a_stack, b_stack)
        self._stacks, self._exact = stacks, exact
        for module in list(self._hooks):
            if module not in stacks:
                self._hooks.pop(module).remove()
        for module in stacks:
            if module not in self._hooks:
                self._hooks[module] = self._linears[module].register_forward_hook(self._hook(module))
        self._slot_of = {name: i for i, name in enumerate(names, start=1)}

    # ---- per-forward routing -----------------------------------------------------------------
    def has(self, name: str | None) -> bool:
        """Whether requests may name `name` (None = the base model, always)."""
        return name is None or name in self.adapters

    def select(self, names: list[str | None], device: Any) -> None:
        """Name each row's adapter (None = base) for the next forward, in row order."""
        import torch

        slots = [0 if n is None else self._slot_of[n] for n in names]
        if not any(slots):
            self._slots, self._single = None, None
        elif len(set(slots)) == 1:
            self._slots, self._single = None, slots[0]
        else:
            self._slots, self._single = torch.tensor(slots, device=device), None

    def _hook(self, module: str) -> Any:
        from verst.rollout.exact_model import is_exact

        def hook(_mod: Any, args: tuple[Any, ...], out: Any) -> Any:
            if self._slots is None and self._single is None:
                return out
            if is_exact(self.model):  # train.exact_on_policy: PEFT's ops in PEFT's order
                return self._exact_delta(module, args[0], out)
            a_stack, b_stack = self._stacks[module]
            x = args[0]  # [batch, T, in]
            if self._single is not None:
                a, b = a_stack[self._single], b_stack[self._single]  # [r, in], [out, r]
                return out + (x @ a.T) @ b.T
            a, b = a_stack[self._slots], b_stack[self._slots]  # [batch, r, in], [batch, out, r]
            return out + (x @ a.transpose(1, 2)) @ b.transpose(1, 2)

        return hook

    def _exact_delta(self, module: str, x: Any, out: Any) -> Any:
        """`out + B(A(x)) * scale` per row's adapter, as PEFT's `lora.Linear` computes it on the
        trainer's side (`exact_linear` for A and B: a row's bits do not depend on the other rows).
        Each adapter's own A and B (no zero-padded rank: another inner size is another
        reduction); rows of one adapter go through together, base rows get nothing added."""
        from verst.rollout.exact_ops import exact_linear

        per_slot = self._exact[module]

        def delta(slot: int, rows: Any) -> Any:
            a, b, scale = per_slot[slot]
            return exact_linear(exact_linear(rows, a), b) * scale

        if self._single is not None:
            return out + delta(self._single, x) if self._single in per_slot else out
        out = out.clone()
        for slot in sorted(set(self._slots.tolist())):
            if slot not in per_slot:
                continue
            idx = (self._slots == slot).nonzero()[:, 0]
            out[idx] = out[idx] + delta(slot, x[idx])
        return out


class LoraEngineMixin(AdapterLoading):
    """SGLang's LoRA surface on `EmbeddedEngine` (uses its command queue and decode batch)."""

    lora_max_rank: int | None = None
    """Largest rank accepted (None = any), as SGLang's `--max-lora-rank`."""
    lora_target_modules: list[str] | None = None
    """Module names adapters may target (None = any linear), as `--lora-target-modules`."""

    def _lora(self) -> EngineAdapters:
        adapters = getattr(self, "_adapters", None)
        if adapters is None:
            adapters = EngineAdapters(
                self.model,  # type: ignore[attr-defined]
                max_rank=self.lora_max_rank,
                target_modules=self.lora_target_modules,
            )
            self._adapters = adapters
            self._batch.adapters = adapters  # type: ignore[attr-defined]
        return adapters

    @property
    def lora_adapters(self) -> dict[str, str]:
        """Loaded adapters: name → the path they came from (SGLang's `loaded_adapters`)."""
        adapters = getattr(self, "_adapters", None)
        return {} if adapters is None else {n: a.path for n, a in adapters.adapters.items()}

    def has_lora_adapter(self, name: str | None) -> bool:
        """Whether a request may name this adapter (None = base model)."""
        adapters = getattr(self, "_adapters", None)
        return name is None or (adapters is not None and adapters.has(name))

    def missing_adapter_error(self, name: str | None) -> InvalidRequest | None:
        """The error for a request naming an adapter that is not loaded (None when it may run)."""
        if self.has_lora_adapter(name):
            return None
        return InvalidRequest(f"LoRA adapter {name!r} is not loaded; loaded: {sorted(self.lora_adapters)}")

    def set_weight_version(self, version: int) -> None:
        """Set the weight version label (SGLang's `/update_weight_version`); weights are unchanged."""
        self._weight_version = int(version)

    async def _load_adapter(self, lora_name: str, source: AdapterSource, weight_version: int | None) -> int:
        """Parse the adapter (a PEFT directory is read in a thread) and put it on the worker thread."""
        if isinstance(source, AdapterFiles):
            tensors, config = await asyncio.to_thread(read_adapter_dir, source.path)
            adapter = parse_adapter(lora_name, tensors, config, path=source.path)
        else:
            adapter = parse_adapter(lora_name, source.tensors, source.config, path="__tensor__")
        return await self._put_adapter(adapter, weight_version)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unload an adapter (requests naming it afterwards are refused)."""
        adapters = self._lora()
        if lora_name not in adapters.adapters:
            raise InvalidRequest(
                f"LoRA adapter {lora_name!r} is not loaded; loaded: {sorted(adapters.adapters)}"
            )

        def apply() -> int:
            adapters.remove(lora_name)
            return 0

        await asyncio.wrap_future(self._command(apply))  # type: ignore[attr-defined]

    async def _put_adapter(self, adapter: Adapter, version: int | None) -> int:
        adapters = self._lora()
        adapters.check(adapter)  # fail here, in the caller, not on the worker thread

        def apply() -> int:
            adapters.put(adapter)
            if version is not None:
                self._weight_version = int(version)  # type: ignore[attr-defined]
            return self._weight_version  # type: ignore[attr-defined]

        return await asyncio.wrap_future(self._command(apply))  # type: ignore[attr-defined]
