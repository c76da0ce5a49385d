"""verst kernels: per-token log-probs, entropy and top-k log-probs over large vocabularies.

Triton kernels (CUDA; CPU under TRITON_INTERPRET=1) and a torch implementation, picked by device
or forced with `backend=`. `linear_*` variants work from hidden states and the LM-head weight in
token chunks so full `[tokens, vocab]` logits never exist. See docs/kernels.md.
"""

from verst.kernels._api import (
    KEEP_LOGITS_MAX_BYTES,
    TopKLogprobs,
    linear_token_logprobs,
    linear_topk_logprobs,
    token_logprobs,
    topk_logprobs,
)
from verst.kernels._dispatch import Backend, triton_available

__all__ = [
    "KEEP_LOGITS_MAX_BYTES",
    "Backend",
    "TopKLogprobs",
    "linear_token_logprobs",
    "linear_topk_logprobs",
    "token_logprobs",
    "topk_logprobs",
    "triton_available",
]
