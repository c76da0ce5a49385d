"""Build the policy (trained) and the reference (frozen) models, the optimizer and the scheduler.

accelerate builds and prepares model, optimizer and scheduler (device placement, mixed
precision, DDP, and FSDP2 on GPUs through its plugin). The one case accelerate gets wrong —
FSDP requested on CPU, where its plugin is silently ignored — is handled here: verst shards with
FSDP2 `fully_shard` directly over gloo (see `verst.trainer.train.fsdp`). With one CPU process FSDP is
refused at validation; `build_policy` re-checks so it can never run unsharded while the config
says FSDP.

`train.dtype` is the *compute* dtype of the trained model: its parameters (and so the AdamW
state and every update) stay float32 masters. With bfloat16 at lr 1e-6 an update is far below
half a bf16 ulp of typical weights, so bf16 parameters would stop changing. Compute runs in the
requested dtype: FSDP2 `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` when sharded,
accelerate's autocast (`mixed_precision="bf16"`) otherwise (a single GPU process included), and
the LM head + log-prob kernels get bf16 hidden states and weight (cast inside the forward, so
gradients flow back to the fp32 masters). The frozen reference model is stored in `train.dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from verst.rollout.errors import ConfigError, Problem
from verst.trainer.config import TrainConfig
from verst.trainer.config_checks import HUB_FIX
from verst.trainer.train.checks import resolve_attn_implementation
from verst.trainer.train.fsdp import DistInfo, decoder_layers, ensure_process_group, is_sharded, shard_fsdp2
from verst.trainer.train.logit_head import check_logit_head
from verst.trainer.train.logprobs import PolicyLogprobs
from verst.trainer.train.optim import adamw, trainable

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_AMP = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}


def mixed_precision_policy(dtype: str) -> Any:
    """FSDP2's policy for compute dtype `dtype` (None for float32): params cast for compute,
    gradients reduced in float32."""
    if dtype == "float32":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=_DTYPES[dtype], reduce_dtype=torch.float32)


def load_hf_model(
    path: str, *, dtype: str, attn_implementation: str, key: str = "train.model_path"
) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained` with the chosen dtype and attention kernel.

    Its LM head is checked against its own forward (`check_logit_head`, one tiny forward, before
    any sharding): an architecture that post-processes logits in a way verst does not know is
    refused instead of trained on log-probs that disagree with the engine's.
    """
    from safetensors import SafetensorError

    from verst.rollout.multimodal.families import auto_model_class

    try:
        model = auto_model_class(path).from_pretrained(
            path, dtype=_DTYPES[dtype], attn_implementation=attn_implementation
        )
    except (OSError, ValueError, SafetensorError) as exc:  # not on the Hub, offline, unknown, corrupt
        raise ConfigError(
            [
                Problem(
                    key,
                    f"cannot load the model {path!r}: {exc}",
                    f"point it at a local model directory; {HUB_FIX}",
                )
            ]
        ) from exc
    try:
        check_logit_head(model)
    except ValueError as exc:
        raise ConfigError(
            [
                Problem(
                    key,
                    str(exc),
                    "train an architecture whose logits verst reproduces (docs/training.md, Log-probs)",
                )
            ]
        ) from exc
    return model


@dataclass
class PolicyBundle:
    """The trained model and what updates it."""

    module: nn.Module
    """What forward/backward go through: the log-prob wrapper, as prepared (FSDP root, DDP...)."""
    inner: PolicyLogprobs
    """The log-prob wrapper itself; `inner.policy` is the Hugging Face model."""
    optimizer: torch.optim.Optimizer
    """AdamW (wrapped by accelerate when it prepared it)."""
    scheduler: Any
    """A LambdaLR, stepped once per optimizer step on every rank (never wrapped by accelerate)."""
    accelerator: Any
    """The `accelerate.Accelerator`, or None on the direct-FSDP2 CPU path."""
    dist: DistInfo
    """This process's place in the world."""
    sharding: str
    """'none', 'fsdp2-direct' (CPU, gloo) or 'fsdp2-accelerate' (GPU)."""
    peft: Any = None
    """The `peft.PeftModel` when `[train.lora]` is on (its base model is `inner.policy`)."""

    @property
    def hf_model(self) -> nn.Module:
        """The underlying Hugging Face model."""
        return self.inner.policy

    def raw_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer under any accelerate wrapper (for state dicts)."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def raw_scheduler(self) -> Any:
        """The torch scheduler under any accelerate wrapper."""
        return getattr(self.scheduler, "scheduler", self.scheduler)


def build_policy(cfg: TrainConfig, model_path: str, *, total_steps: int, dist_info: DistInfo) -> PolicyBundle:
    """Load the policy, shard it if asked, and build AdamW + the lr schedule."""
    cuda = torch.cuda.is_available()
    hf, peft_model = _load_policy(cfg, model_path, cuda=cuda)
    if cfg.exact_on_policy:  # the engine's batch-invariant ops (verst.rollout.exact_model)
        from verst.rollout.exact_model import install_exact

        install_exact(hf)
    compute = None if cfg.dtype == "float32" else _DTYPES[cfg.dtype]
    module = PolicyLogprobs(
        hf,
        backend="exact" if cfg.exact_on_policy else cfg.logprob_backend,
        chunk_size=cfg.logprob_chunk_size,
        compute_dtype=compute,
        keep_logits_mib=cfg.logprob_keep_logits_mib,
    )
    if cfg.fsdp and not cuda:
        _shard_direct(cfg, module, hf, dist_info)
        opt, sched = adamw(trainable(module), cfg, fsdp=cfg.fsdp, schedule=cfg, total_steps=total_steps)
        return PolicyBundle(module, module, opt, sched, None, dist_info, "fsdp2-direct", peft_model)
    accelerator = _accelerator(cfg, hf, cuda=cuda)
    opt, sched = adamw(trainable(module), cfg, fsdp=cfg.fsdp, schedule=cfg, total_steps=total_steps)
    # The scheduler is NOT prepared: accelerate's AcceleratedScheduler steps the wrapped scheduler
    # once per process per optimizer step (split_batches=False), so with N ranks the schedule ran
    # N times too fast. The plain LambdaLR steps once per optimizer step on every rank; it only
    # writes param_groups' lr, which the prepared optimizer shares.
    prepared, opt = accelerator.prepare(module, opt)
    inner = accelerator.unwrap_model(prepared)
    sharding = "fsdp2-accelerate" if cfg.fsdp else "none"
    return PolicyBundle(prepared, inner, opt, sched, accelerator, dist_info, sharding, peft_model)


def _load_policy(cfg: TrainConfig, model_path: str, *, cuda: bool) -> tuple[nn.Module, Any]:
    """The Hugging Face model in float32 masters (checkpointing, frozen vision tower and LoRA
    adapters applied) and its `peft.PeftModel` (None without `[train.lora]`)."""
    attn = resolve_attn_implementation(cfg.attn_implementation, cuda=cuda)
    hf = load_hf_model(model_path, dtype="float32", attn_implementation=attn)  # fp32 masters
    if cfg.gradient_checkpointing:
        # non-reentrant: recomputes correctly when the frozen embeddings' output needs no grad (LoRA)
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.config.use_cache = False
    _freeze_vision(hf, cfg, model_path)
    if cfg.lora is None:
        return hf, None
    from verst.trainer.train.lora import apply_lora

    peft_model = apply_lora(hf, cfg.lora)
    return peft_model.get_base_model(), peft_model  # the same modules, adapters injected


def _shard_direct(cfg: TrainConfig, module: nn.Module, hf: nn.Module, dist_info: DistInfo) -> None:
    """FSDP on CPU: `fully_shard` over gloo ourselves (accelerate ignores its plugin on CPU)."""
    if not dist_info.distributed:
        raise RuntimeError(
            "train.fsdp=true on CPU with one process would run unsharded (accelerate ignores its "
            "FSDP plugin on CPU); launch 2+ processes with torchrun or set train.fsdp=false"
        )
    ensure_process_group(dist_info, cuda=False)
    shard_fsdp2(module, hf, mp_policy=mixed_precision_policy(cfg.dtype))
    if not any(is_sharded(p) for p in module.parameters()):
        raise RuntimeError("FSDP2 sharding left every parameter whole; refusing to train unsharded")


def _accelerator(cfg: TrainConfig, hf: nn.Module, *, cuda: bool) -> Any:
    """The `accelerate.Accelerator` (with its FSDP2 plugin when `train.fsdp` on GPUs)."""
    from accelerate import Accelerator

    plugin = None
    if cfg.fsdp:
        from accelerate import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            # the decoder's blocks only (a VLM's vision blocks stay in the root unit, as on CPU)
            transformer_cls_names_to_wrap=sorted({type(m).__name__ for m in decoder_layers(hf)}),
            reshard_after_forward=True,
            mixed_precision_policy=mixed_precision_policy(cfg.dtype),
        )
    return Accelerator(cpu=not cuda, fsdp_plugin=plugin, mixed_precision=_AMP[cfg.dtype])


def _freeze_vision(hf: nn.Module, cfg: TrainConfig, model_path: str) -> None:
    """`train.vision.freeze`: a vision-language model's vision tower gets no gradients."""
    from verst.rollout.multimodal.families import FAMILIES

    kind = FAMILIES.get(getattr(hf.config, "model_type", ""))
    if kind is None or not cfg.vision.freeze:
        return
    from verst.rollout.multimodal.families import LlavaFamily

    tower = hf.model.vision_tower if kind == LlavaFamily.name else hf.model.vision_model
    tower.requires_grad_(False)


def build_reference(
    cfg: TrainConfig, model_path: str, dist_info: DistInfo, *, key: str = "train.ref_model_path"
) -> PolicyLogprobs:
    """The frozen reference model (no grads; sharded like the policy when FSDP is on)."""
    cuda = torch.cuda.is_available()
    hf = load_hf_model(
        model_path,
        dtype=cfg.dtype,
        attn_implementation=resolve_attn_implementation(cfg.attn_implementation, cuda=cuda),
        key=key,
    )
    hf.requires_grad_(False)
    hf.eval()
    module = PolicyLogprobs(hf, backend=cfg.logprob_backend, chunk_size=cfg.logprob_chunk_size)
    if cfg.fsdp and dist_info.distributed:
        ensure_process_group(dist_info, cuda=cuda)
        shard_fsdp2(module, hf, device=torch.device("cuda", dist_info.local_rank) if cuda else None)
    elif cuda:
        module.to(torch.device("cuda", dist_info.local_rank))
    return module
