"""What a causal LM does between its decoder and its logits, so the trainer's log-probs match it.

The trainer runs only the decoder and computes log-probs from the hidden states and the LM-head
weight (chunked, see `verst.trainer.train.logprobs`), bypassing `*ForCausalLM.forward`. Several
families post-process the head's output there, and the engine (which runs the whole forward)
samples from the post-processed logits; skipping it makes trainer and engine disagree silently
(a tiny Granite with `logits_scaling = 4`: -4.181 vs -4.163 per token), which feeds the PPO
ratio and TIS. `LogitHead` describes the head as `post(hidden @ W.T + b)` with

- `scale`: a positive multiplier (Granite `1 / logits_scaling`, Cohere `logit_scale`, Falcon-H1
  `lm_head_multiplier`, HyperCLOVA X `logits_scaling`), folded into the temperature;
- `softcap`: `cap * tanh(x / cap)` after the scale (Gemma-2/3/3n/4, VaultGemma, NanoChat
  `final_logit_softcapping`, RecurrentGemma `logits_soft_cap`, xLSTM `output_logit_soft_cap`),
  applied per chunk inside the kernel;
- the LM head's bias (Phi, GPT-J, CodeGen...) and a vocabulary cut (Inkling
  `unpadded_vocab_size`).

`check_logit_head` runs the model's own forward once on a few tokens and compares: an
architecture whose head does something else is refused with a clear error instead of being
trained on wrong log-probs. A new family is one table entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def _inverse(attr: str) -> Callable[[nn.Module, Any], float]:
    return lambda model, cfg: 1.0 / float(getattr(cfg, attr))


def _config_attr(attr: str) -> Callable[[nn.Module, Any], float]:
    return lambda model, cfg: float(getattr(cfg, attr))


def _module_attr(path: str) -> Callable[[nn.Module, Any], float]:
    def get(model: nn.Module, cfg: Any) -> float:
        obj: Any = model
        for name in path.split("."):
            obj = getattr(obj, name)
        return float(obj)

    return get


LOGIT_SCALES: dict[str, Callable[[nn.Module, Any], float]] = {
    "GraniteForCausalLM": _inverse("logits_scaling"),
    "GraniteSWAForCausalLM": _inverse("logits_scaling"),
    "GraniteMoeForCausalLM": _inverse("logits_scaling"),
    "GraniteMoeSWAForCausalLM": _inverse("logits_scaling"),
    "GraniteMoeHybridForCausalLM": _inverse("logits_scaling"),
    "GraniteMoeSharedForCausalLM": _inverse("logits_scaling"),
    "CohereForCausalLM": _module_attr("logit_scale"),
    "Cohere2ForCausalLM": _module_attr("logit_scale"),
    "Cohere2MoeForCausalLM": _module_attr("logit_scale"),
    "CohereCompassForCausalLM": _module_attr("logit_scale"),
    "FalconH1ForCausalLM": _module_attr("model.lm_head_multiplier"),
    "HyperCLOVAXForCausalLM": _config_attr("logits_scaling"),
}
"""`*ForCausalLM` class name → the multiplier its forward applies to the LM head's output
(transformers 5.19; the classes not listed apply none)."""

SOFTCAP_ATTRS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
"""Text-config fields holding a final logit soft-cap (`cap * tanh(x / cap)`), None = off."""


@dataclass(frozen=True)
class LogitHead:
    """The LM head as `post(hidden @ weight.T + bias)`: see the module docstring."""

    weight: torch.Tensor  # [V, H]
    """The LM-head weight (cut to the real vocabulary where the model pads it)."""
    bias: torch.Tensor | None = None  # [V]
    """The LM head's bias, if it has one."""
    scale: float = 1.0
    """Multiplier applied to the head's output (> 0)."""
    softcap: float | None = None
    """Soft-cap applied after the scale, or None."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full post-processed logits `[N, V]` in float32 (the direct path and the check)."""
        x = hidden.float() @ self.weight.float().T
        if self.bias is not None:
            x = x + self.bias.float()
        if self.scale != 1.0:
            x = x * self.scale
        if self.softcap is not None:
            x = torch.tanh(x / self.softcap) * self.softcap
        return x

    def kernel_args(self, temperature: float) -> dict[str, Any]:
        """`verst.kernels.linear_*` arguments for `log_softmax(post(h @ W.T + b) / temperature)`.

        The scale folds into the temperature and the cap: `cap * tanh(s x / cap) / T` equals
        `(cap/s) * tanh(x / (cap/s)) / (T/s)`.
        """
        return {
            "lm_head_weight": self.weight,
            "temperature": temperature / self.scale,
            "lm_head_bias": self.bias,
            "softcap": None if self.softcap is None else self.softcap / self.scale,
        }


def logit_head(model: nn.Module) -> LogitHead:
    """The `LogitHead` of a Hugging Face causal LM (read from its class and config)."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(
            f"{type(model).__name__} has no linear output embedding (get_output_embeddings() is "
            f"{type(head).__name__}); verst computes log-probs from the LM-head weight"
        )
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    name = type(model).__name__
    scale = LOGIT_SCALES[name](model, text) if name in LOGIT_SCALES else 1.0
    if not (scale > 0 and scale < float("inf")):
        raise ValueError(
            f"{name} scales its logits by {scale}; verst supports a finite positive logit scale only"
        )
    caps = [getattr(text, a, None) for a in SOFTCAP_ATTRS]
    softcap = next((float(c) for c in caps if c is not None), None)
    weight, bias = head.weight, getattr(head, "bias", None)
    cut = getattr(text, "unpadded_vocab_size", None)
    if cut is not None and int(cut) < weight.shape[0]:
        weight = weight[: int(cut)]
        bias = bias[: int(cut)] if bias is not None else None
    return LogitHead(weight=weight, bias=bias, scale=scale, softcap=softcap)


@torch.no_grad()
def check_logit_head(model: nn.Module, *, num_tokens: int = 4) -> LogitHead:
    """`logit_head(model)`, verified against the model's own forward on `num_tokens` tokens.

    Raises a ValueError naming the class when the head's logits differ from `model(...).logits`
    (an architecture whose head verst does not know). Run it before sharding (one tiny forward).
    """
    head = logit_head(model)
    was_training = model.training
    model.eval()
    try:
        device = head.weight.device
        ids = (torch.arange(num_tokens, device=device) % head.weight.shape[0])[None, :]  # [1, num_tokens]
        expected = model(input_ids=ids, use_cache=False).logits[0].float()  # [num_tokens, V]
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]
        got = head.logits(hidden)
    finally:
        model.train(was_training)
    eps = 1e-4 if head.weight.dtype == torch.float32 else 3e-2
    tol = eps * max(1.0, float(expected.abs().max()))
    if got.shape != expected.shape or float((got - expected).abs().max()) > tol:
        err = float((got - expected).abs().max()) if got.shape == expected.shape else float("nan")
        raise ValueError(
            f"{type(model).__name__}: log-probs from the LM head (scale {head.scale}, soft-cap "
            f"{head.softcap}, bias {head.bias is not None}) do not match the model's own logits "
            f"(max |diff| {err:.3g}, shapes {tuple(got.shape)} vs {tuple(expected.shape)}): its "
            "forward post-processes logits in a way verst does not know, so trainer and engine "
            "log-probs would disagree. Add the class to verst.trainer.train.logit_head.LOGIT_SCALES (or "
            "SOFTCAP_ATTRS), or train a supported architecture"
        )
    return head
