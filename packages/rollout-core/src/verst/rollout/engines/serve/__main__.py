"""`python -m verst.rollout.engines.serve ...`: the same program as `verst serve`."""

from verst.rollout.engines.serve.server import main

main()
