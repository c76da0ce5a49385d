"""`train.exact_on_policy`: where it cannot hold, the run refuses it before any work.

It holds for the embedded engine on CPU, float32 on both sides, the families of
`verst.rollout.exact_model.FAMILIES` (dense, and Qwen3-MoE / Mixtral with or without routing
replay), one process, LoRA without dropout, any `train.layout` (docs/training.md, Exactly
on-policy).
Every other case is one `Problem` under `train.exact_on_policy` naming why and the fix: vLLM and
SGLang (and `verst serve` behind the SGLang client) run their own kernels, a GPU has no
batch-invariant kernels here, a family not covered would be approximated, LoRA dropout draws a
random mask in the training forward that the engine does not, and speculative decoding
(`engine.speculative`) is refused: its verify forward feeds `k + 1` tokens per row into a cache
with masked (rejected) columns, its log-probs come from `verify` rather than `exact_logprobs`,
and the kept positions' bits are not those of the one-token step the trainer's exact forward
matches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verst.rollout.errors import Problem

if TYPE_CHECKING:
    from verst.trainer.config import RunConfig

KEY = "train.exact_on_policy"
FIX = "set train.exact_on_policy = false"


def _engine_reason(engine: Any, cuda: bool) -> str | None:
    if engine.type != "embedded":
        return (
            f"engine.type={engine.type!r} computes its log-probs with its own kernels; only the "
            "embedded engine runs the trainer's batch-invariant ops"
        )
    if engine.device == "cuda" or (engine.device == "auto" and cuda):
        return "the embedded engine on a GPU: batch-invariant kernels exist for CPU only"
    if engine.dtype != "float32":
        return f"engine.dtype={engine.dtype!r}: only float32 is covered"
    spec = getattr(engine, "speculative", None)
    if spec is not None and spec.enabled:
        return (
            f"engine.speculative.type={spec.type!r}: the verify forward scores k + 1 positions per row "
            "against a cache with masked holes and reports verify's log-probs, not the exact ops' "
            '(set engine.speculative.type = "off")'
        )
    return None


def _model_reasons(path: str | None) -> list[str]:
    """The model's own reasons (`exact_problems`), when its config can be read locally."""
    if path is None:
        return []
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception:  # the model-path checks report an unreadable model
        return []
    from verst.rollout.exact_model import exact_problems

    return exact_problems(config, "float32")


def exact_on_policy_problems(cfg: RunConfig, *, cuda_available: bool, world_size: int) -> list[Problem]:
    """Why `train.exact_on_policy` cannot hold for `cfg` (empty when off or when it can)."""
    train = cfg.train
    if not train.exact_on_policy:
        return []
    reasons: list[str] = []
    engine_reason = _engine_reason(cfg.engine, cuda_available)
    if engine_reason is not None:
        reasons.append(engine_reason)
    if cuda_available:
        reasons.append("the trainer would run on a GPU: batch-invariant kernels exist for CPU only")
    if train.dtype != "float32":
        reasons.append(f"train.dtype={train.dtype!r}: only float32 is covered")
    if train.lora is not None and train.lora.dropout:
        reasons.append(
            f"train.lora.dropout={train.lora.dropout}: the training forward's dropout mask is not the "
            "engine's (set it to 0)"
        )
    if world_size > 1 or train.fsdp or cfg.run.placement == "ray":
        reasons.append("one trainer process only (no FSDP, no Ray placement)")
    reasons += _model_reasons(train.model_path or getattr(cfg.engine, "model_path", None))
    return [Problem(KEY, f"cannot hold: {r}", FIX) for r in reasons]
