"""Speculative decoding in the embedded engine (`engine.speculative`).

`config` (the proposer table `SPECULATIVE`; light), `verify` (the speculative-sampling rule over
filtered target distributions), `step` (`SpeculativeDecoder`: the decode-step hook, KV rollback,
stats), `ngram` (prompt lookup), `draft` (a draft model). May import `embedded.sampling`.
"""
