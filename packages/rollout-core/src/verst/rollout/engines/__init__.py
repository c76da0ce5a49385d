"""Inference engines: the embedded engine, `verst serve`, the SGLang client, launchers, pools.

Import from the defining modules (`verst.rollout.engines.embedded`, `.sglang_client`, ...);
this package imports nothing heavy so that `verst.rollout.engines.config` stays light.
"""
