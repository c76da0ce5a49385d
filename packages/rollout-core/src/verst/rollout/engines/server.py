"""Old documented path of `python -m verst.rollout.engines.server`; `verst serve` lives in
`verst.rollout.engines.serve`."""

from verst.rollout.engines.serve.server import main

if __name__ == "__main__":
    main()
