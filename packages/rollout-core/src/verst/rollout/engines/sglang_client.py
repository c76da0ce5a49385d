"""Old documented path of `SGLangClient`, kept for users; it lives in `verst.rollout.engines.sglang`."""

from verst.rollout.engines.sglang.client import SGLangClient

__all__ = ["SGLangClient"]
