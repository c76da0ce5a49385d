"""Old documented path of `InProcessOpenAI`, kept for users; it lives in `verst.rollout.engines.serve`."""

from verst.rollout.engines.serve.inprocess_openai import InProcessOpenAI

__all__ = ["InProcessOpenAI"]
