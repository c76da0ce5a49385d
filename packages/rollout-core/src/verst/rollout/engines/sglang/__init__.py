"""SGLang over HTTP: `SGLangClient` (`client`), its LoRA calls (`lora`), and the launchers that
start SGLang servers, a router or `verst serve` processes (`launcher`)."""

from verst.rollout.engines.sglang.client import SGLangClient

__all__ = ["SGLangClient"]
