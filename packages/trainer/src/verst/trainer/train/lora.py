"""`[train.lora]`: train a LoRA adapter (PEFT) instead of the whole policy.

Only the adapter's A/B matrices require grad and sit in the optimizer; the base weights are
frozen and loaded once. The reference model for KL is the same model with the adapter switched
off (`PeftModel.disable_adapter`), so no second copy is loaded. A refit ships only the adapter
(PEFT tensor names, `adapter_config.json`), in-process or as a PEFT directory, to an engine
that applies it on its base weights; checkpoints hold the adapter and its optimizer state.

The config checks here run before any weights load: a target module the model does not have
(the model is built on the meta device from its config), rank ≤ 0 (pydantic), a separate
reference model, distributed weight sync, Ray placement, an engine that cannot serve adapters.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from verst.rollout.config import CONFIG_PATH, Section
from verst.rollout.errors import ConfigError, Problem

if TYPE_CHECKING:
    from verst.trainer.config import RunConfig

INSTALL = "uv sync --extra lora"
"""How to get PEFT."""


class LoraSection(Section):
    """A LoRA adapter trained on a frozen base (PEFT), served by the engine on the base weights."""

    rank: int = Field(8, gt=0, description="LoRA rank r (> 0).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the linear layers that get an adapter (matched against the last "
        "part of each module name, as PEFT does).",
    )
    adapter_name: str = Field(
        "policy", min_length=1, description="Name the engine serves the trained adapter under."
    )
    serve: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra={CONFIG_PATH: True},  # each path resolves against the config's folder
        description="Extra frozen adapters the engine serves beside the trained one (name → PEFT "
        "directory); a sample picks one with rollout.lora_key in its metadata (multi-LoRA).",
    )


def require_peft() -> Any:
    """Import peft, or say how to install it."""
    try:
        import peft
    except ModuleNotFoundError as exc:
        if exc.name != "peft":
            raise
        raise ModuleNotFoundError(
            f"train.lora needs the 'peft' package; install it with `{INSTALL}`", name="peft"
        ) from None
    return peft


# ---------------------------------------------------------------- validation


def linear_module_names(model_path: str) -> list[str] | None:
    """Names of the model's linear layers, from its config on the meta device (no weights load);
    None when the config cannot be read (the missing model is reported elsewhere)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def lora_problems(cfg: RunConfig, model_path: str | None) -> list[Problem]:
    """Everything wrong with `[train.lora]` in this run, before anything loads."""
    lora = cfg.train.lora
    if lora is None:
        return []
    out = []
    try:
        require_peft()
    except ModuleNotFoundError as exc:
        out.append(Problem("train.lora", str(exc), f"run `{INSTALL}`"))
    if cfg.train.ref_model_path is not None:
        out.append(
            Problem(
                "train.ref_model_path",
                "with train.lora the reference is the base model with the adapter disabled; a "
                "separate reference model would not be loaded",
                "remove train.ref_model_path (or train without [train.lora])",
            )
        )
    if not cfg.train.weight_sync.resolve(cfg.engine.capabilities()).adapters:  # e.g. 'distributed'
        out.append(
            Problem(
                "train.weight_sync",
                "LoRA refits ship only the adapter (tensors in-process, or a PEFT directory); "
                "'distributed' broadcasts full weights",
                "use weight_sync='auto', 'tensors' (embedded engine) or 'disk'",
            )
        )
    if cfg.run.placement == "ray":
        out.append(
            Problem(
                "run.placement",
                "LoRA is wired for the local placement (the Ray actors do not carry adapter refits yet)",
                "use run.placement='local' (torchrun for FSDP), or train without [train.lora]",
            )
        )
    out += engine_lora_problems(cfg)
    out += _target_problems(lora, model_path)
    out += _served_adapter_problems(lora)
    return out


def _target_problems(lora: LoraSection, model_path: str | None) -> list[Problem]:
    """`train.lora.target_modules` that are not linear layers of the model (when it can be read)."""
    names = linear_module_names(model_path) if model_path is not None else None
    if names is None:
        return []
    short = {n.rsplit(".", 1)[-1] for n in names}
    missing = [t for t in lora.target_modules if t not in short]
    if not missing:
        return []
    return [
        Problem(
            "train.lora.target_modules",
            f"{missing} are not linear layers of {model_path}",
            f"choose among {sorted(short)}",
        )
    ]


def _served_adapter_problems(lora: LoraSection) -> list[Problem]:
    """Extra adapters (`train.lora.serve`): a name clash with the trained one, or not a PEFT folder."""
    out = []
    if lora.adapter_name in lora.serve:
        out.append(
            Problem(
                "train.lora.serve",
                f"{lora.adapter_name!r} is the trained adapter's name",
                "give the extra adapter another name, or set train.lora.adapter_name",
            )
        )
    for name, path in lora.serve.items():
        if not (Path(path) / "adapter_config.json").is_file():
            out.append(
                Problem(
                    f"train.lora.serve.{name}",
                    f"{path!r} is not a PEFT adapter directory",
                    "give a folder with adapter_config.json and adapter_model.safetensors",
                )
            )
    return out


def engine_serves_lora(cfg: RunConfig) -> bool:
    """Whether the configured engine can apply adapters on its base weights."""
    return cfg.engine.capabilities().lora


def engine_lora_problems(cfg: RunConfig) -> list[Problem]:
    """LoRA with an engine that cannot serve adapters."""
    if engine_serves_lora(cfg):
        return []
    return [
        Problem(
            "engine.type",
            f"engine type {cfg.engine.type!r} cannot serve LoRA adapters (its capabilities say "
            "lora=False), so the trained adapter has no way to reach the rollouts",
            "use engine.type='embedded', 'sglang' (servers launched with --enable-lora) or "
            "'sglang_launch', or train without [train.lora]",
        )
    ]


# ---------------------------------------------------------------- the model


def _vision_exclude(hf: Any) -> str | None:
    """A vision-language model's adapters go on its language model only: the vision tower and
    projector modules are excluded (PEFT's `exclude_modules`, a regex over module names)."""
    from verst.rollout.multimodal.families import is_vision_config

    if not is_vision_config(hf.config):
        return None
    return r".*(vision_tower|vision_model|multi_modal_projector|connector)\b.*"


def apply_lora(hf: Any, lora: LoraSection) -> Any:
    """Wrap a Hugging Face model with a fresh PEFT adapter; only adapter params require grad."""
    peft = require_peft()
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        exclude_modules=_vision_exclude(hf),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(hf, config)


def peft_name(param_name: str) -> str | None:
    """A parameter name under the log-prob wrapper (`policy.<module>.lora_A.default.weight`) →
    its PEFT adapter-file name (`base_model.model.<module>.lora_A.weight`); None if not LoRA."""
    if ".lora_A." not in param_name and ".lora_B." not in param_name:
        return None
    name = param_name.removeprefix("policy.")
    for ab in ("lora_A", "lora_B"):
        head, sep, tail = name.partition(f".{ab}.")
        if sep:
            return f"base_model.model.{head}.{ab}.weight" if tail.endswith("weight") else None
    return None


def adapter_params(module: Any) -> Iterator[tuple[str, Any]]:
    """(PEFT name, parameter) of every adapter parameter under `module`, in a fixed order."""
    for name, p in module.named_parameters():
        pname = peft_name(name)
        if pname is not None:
            yield pname, p


def adapter_config_dict(peft_model: Any) -> dict[str, Any]:
    """The adapter's `adapter_config.json` content (JSON-ready)."""
    cfg = peft_model.peft_config["default"]
    return json.loads(
        json.dumps(cfg.to_dict(), default=lambda o: sorted(o) if isinstance(o, set) else str(o))
    )


def save_adapter(path: str | Path, tensors: dict[str, Any], config: dict[str, Any]) -> None:
    """Write a PEFT adapter directory (`adapter_model.safetensors` + `adapter_config.json`)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
        str(path / "adapter_model.safetensors"),
    )
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))


class LoraState:
    """The trained adapter of a policy bundle: its tensors, config, checkpoint files, and the
    adapter-disabled view used as the KL reference."""

    def __init__(self, bundle: Any, section: LoraSection) -> None:
        self.bundle = bundle
        self.section = section
        self.name = section.adapter_name
        """The name the engine serves it under."""
        self.config = adapter_config_dict(bundle.peft)
        """Its `adapter_config.json` content."""
        self._fqn = {pname: fqn for fqn, pname in _fqn_pairs(bundle.module)}

    def adapter_disabled(self) -> Any:
        """Context manager: forwards run the frozen base model."""
        return self.bundle.peft.disable_adapter()

    def state(self, *, is_main: bool = True) -> dict[str, Any]:
        """PEFT name → whole tensor (gathered from the shards; a collective under FSDP)."""
        from verst.trainer.train.fsdp import full_tensor

        out = {}
        for pname, p in adapter_params(self.bundle.inner):
            t = full_tensor(p.detach())
            if is_main:
                out[pname] = t.cpu() if self.bundle.sharding != "none" else t
        return out

    def save(self, path: str | Path, tensors: dict[str, Any]) -> None:
        """Write the adapter as a PEFT directory."""
        save_adapter(path, tensors, self.config)

    def load(self, path: str | Path) -> None:
        """Restore the adapter from a PEFT directory written by `save` (every rank reads it)."""
        import torch
        from safetensors.torch import load_file

        file = Path(path) / "adapter_model.safetensors"
        if not file.is_file():
            raise RuntimeError(
                f"{Path(path).parent} is not a LoRA checkpoint (no adapter/adapter_model.safetensors): it "
                "was written by a full fine-tuning run; resume it without [train.lora], or start a new "
                "run directory (run.output_dir) or set run.resume=false"
            )
        self._check_saved_config(Path(path))
        sd = load_file(str(file))
        missing = sorted(set(self._fqn) - set(sd))
        unexpected = sorted(set(sd) - set(self._fqn))
        if missing or unexpected:
            raise RuntimeError(
                f"adapter checkpoint {path} does not match [train.lora]: missing {missing[:4]}, "
                f"unexpected {unexpected[:4]} (was it saved with another rank or target_modules?)"
            )
        if self.bundle.sharding == "none":
            params = dict(adapter_params(self.bundle.inner))
            with torch.no_grad():
                for pname, t in sd.items():
                    params[pname].copy_(t)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(
            self.bundle.module,
            {self._fqn[k]: v for k, v in sd.items()},
            options=StateDictOptions(full_state_dict=True, strict=False),
        )

    def _check_saved_config(self, path: Path) -> None:
        """Refuse an adapter saved with another rank or alpha (the shapes, or silently the
        alpha / rank scale, would change), naming the saved and the configured values."""
        config_file = path / "adapter_config.json"
        if not config_file.is_file():
            return
        saved = json.loads(config_file.read_text())
        problems = [
            Problem(
                f"train.lora.{key}",
                f"the checkpoint's adapter ({path}) was saved with {key} = {saved[peft_key]!r}; the config "
                f"sets {key} = {self.config.get(peft_key)!r}",
                f"set train.lora.{key} = {saved[peft_key]!r} to resume this run, or start a new run "
                "directory (run.output_dir) or set run.resume = false",
            )
            for key, peft_key in (("rank", "r"), ("alpha", "lora_alpha"))
            if peft_key in saved and saved[peft_key] != self.config.get(peft_key)
        ]
        if problems:
            raise ConfigError(problems)


def _fqn_pairs(module: Any) -> Iterator[tuple[str, str]]:
    for fqn, _p in module.named_parameters():
        pname = peft_name(fqn.removeprefix("module."))
        if pname is not None:
            yield fqn, pname
