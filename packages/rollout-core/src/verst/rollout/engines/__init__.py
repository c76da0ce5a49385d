"""Inference engines, one subpackage each, plus what they share.

- `config` — the `[engine]` section: the `ENGINES` table and `build_engine` (light: no torch, no aiohttp).
- `pool` — `EnginePool`, several engines behind one `InferenceEngine`.
- `common/` — shared by every engine and client: errors and request ids, the SGLang native wire
  types, HTTP with retries, the weight-update group, CUDA IPC, LoRA adapter views.
- `embedded/` — `EmbeddedEngine`: a HF causal LM in this process (batching, sampling, attention, LoRA).
- `sglang/` — `SGLangClient` (SGLang servers, a router, or `verst serve` over HTTP), its LoRA calls,
  and the launchers that start servers.
- `serve/` — `verst serve`: the embedded engine behind SGLang's native HTTP API and the OpenAI API,
  and the in-process OpenAI client.

May import: `common` imports only `verst.rollout` (never a sibling); `embedded`, `sglang` import `common`;
`serve` imports `common` and `embedded`. This package imports nothing heavy.
"""
