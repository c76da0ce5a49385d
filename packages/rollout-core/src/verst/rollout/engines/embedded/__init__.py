"""The embedded engine: a Hugging Face causal LM in this process (`EmbeddedEngine`).

`engine` (the engine and its worker thread), `batch` (the decode batch), `sampling`,
`attention` (grouped SDPA for shared prompts), `lora` (adapters on the base weights).
"""

from verst.rollout.engines.embedded.engine import EmbeddedEngine

__all__ = ["EmbeddedEngine"]
