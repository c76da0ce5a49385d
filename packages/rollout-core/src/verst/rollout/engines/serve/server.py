"""`verst serve`: the embedded engine behind SGLang's native HTTP API (the subset RL uses).

    verst serve --model PATH --host 127.0.0.1 --port 30000
    python -m verst.rollout.engines.serve.server --model PATH --port 30000

Endpoints: /generate (single, batch, SSE stream), /abort_request, /health, /health_generate,
/model_info, /server_info (+ get_ aliases), /flush_cache, /pause_generation,
/continue_generation, /update_weights_from_disk, /update_weights_from_tensor, /v1/loads,
/release_memory_occupation, /resume_memory_occupation, /init_weights_update_group,
/update_weights_from_distributed (gloo on CPU, NCCL on CUDA; the group SGLang builds, see
`weight_group`), /destroy_weights_update_group, /begin_weight_update, /end_weight_update, and the
OpenAI API (`openai_api`: /v1/models, /v1/completions, /v1/chat/completions;
`--served-model-name`, `--tool-call-parser`).
Bad requests get a 4xx in SGLang's shapes (`{"error": {"message"}}` from /generate, an
`ErrorResponse` `{"object": "error", "message", "type", "code"}` elsewhere); the server never
dies on one.

It enforces SGLang 0.5.23's protocol so the client's tests catch a regression: tensor and
distributed updates outside a `/begin_weight_update` … `/end_weight_update` session fail
(`success: false`); `/abort_request` matches a rid exactly (an empty rid without `abort_all` is
ignored); `weight_version` is a string, `"default"` until set (unless `--weight-version`), and
an update without one keeps it; `/release_memory_occupation` needs an idle or paused server,
`tags: null` releases weights too, released weights come back on resume only with
`--enable-weights-cpu-backup` (else a refit must load them), and generating or refitting into
released memory is refused instead of computing on freed buffers.

`--inject-latency-ms MEAN --inject-latency-fraction F` delays a seeded random fraction F of
/generate requests by a uniform 0.5–1.5 × MEAN ms before they reach the engine (an aborted
delayed request returns at once with finish `abort`), to simulate long-tailed generation.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from verst.rollout.engines.common.weight_group import DistributedRefit
from verst.rollout.engines.serve.lora_http import add_lora_args, add_lora_routes
from verst.rollout.engines.serve.native import add_native_routes
from verst.rollout.engines.serve.openai_api import register_openai_routes
from verst.rollout.engines.serve.state import (
    DEFAULT_MAX_REQUEST_SEQUENCES,
    DEFAULT_MAX_REQUEST_TOKENS,
    MAX_REQUEST_SEQUENCES,
    MAX_REQUEST_TOKENS,
    REFIT,
    SHUTDOWN_TIMEOUT_S,
    STATE,
    LatencyInjection,
    ServerState,
    error_middleware,
)
from verst.rollout.engines.serve.weights import add_weight_routes

__all__ = ["LatencyInjection", "build_app", "main", "make_parser"]

log = logging.getLogger("verst.serve")
OPENAI_ARGS = ("model_name", "tool_call_parser")


def build_app(
    engine: Any,
    *,
    latency: LatencyInjection | None = None,
    info: dict[str, Any] | None = None,
    max_request_tokens: int | None = DEFAULT_MAX_REQUEST_TOKENS,
    max_request_sequences: int | None = DEFAULT_MAX_REQUEST_SEQUENCES,
) -> web.Application:
    """The aiohttp application serving `engine` (an `EmbeddedEngine`) over SGLang's native API.

    A /generate call with more sequences than `max_request_sequences` (prompts × n) or more
    tokens than `max_request_tokens` (Σ n × (prompt + max_new_tokens)) is refused with HTTP 413
    (None = unbounded). On shutdown every request is aborted first (so
    SIGTERM on a busy server exits in seconds), then the engine is closed.
    """
    latency = latency or LatencyInjection()
    latency.rng = random.Random(latency.seed)
    app = web.Application(middlewares=[error_middleware], client_max_size=1 << 30)
    app[STATE] = ServerState(engine, dict(info or {}), latency)
    app[REFIT] = DistributedRefit()
    app[MAX_REQUEST_TOKENS] = max_request_tokens
    app[MAX_REQUEST_SEQUENCES] = max_request_sequences
    add_native_routes(app)
    add_weight_routes(app)
    register_openai_routes(app, engine, **{k: v for k, v in (info or {}).items() if k in OPENAI_ARGS})
    add_lora_routes(app, engine, enabled=bool(app[STATE].info.get("enable_lora")), state=app[STATE])

    async def _close(app: web.Application) -> None:
        app[REFIT].close()
        await app[STATE].engine.close(timeout_s=SHUTDOWN_TIMEOUT_S)

    async def _abort_all(app: web.Application) -> None:
        state = app[STATE]
        state.stopping = True  # before the abort: nothing reaches the engine after it
        for event in list(state.delayed.values()):
            event.set()
        try:
            await asyncio.wait_for(state.engine.abort(None), SHUTDOWN_TIMEOUT_S)
        except Exception as exc:  # shutting down anyway
            log.warning("abort on shutdown failed: %s: %s", type(exc).__name__, exc)

    app.on_shutdown.append(_abort_all)
    app.on_cleanup.append(_close)
    return app


_EXACT_HELP = "report log-probs bit-equal to the trainer's (batch-invariant CPU ops; docs/training.md)"
_SPECULATIVE_HELP = (
    "speculative decoding: a proposer name (ngram) or a JSON table, e.g. "
    '\'{"type": "draft_model", "model_path": "draft", "num_tokens": 4}\' (default off; docs/engines.md)'
)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="verst serve",
        description="Serve a Hugging Face causal LM over SGLang's native HTTP API (embedded engine).",
    )
    p.add_argument("--model", "--model-path", dest="model", required=True, help="model directory (HF layout)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port (default 30000)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="device (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-batch-size", type=int, default=64, help="rows decoded together (default 64)")
    p.add_argument("--context-length", type=int, default=None, help="override the model's context length")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--weight-version",
        type=int,
        default=None,
        help='initial weight version (default: reported as "default", read as 0, like SGLang)',
    )
    p.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="released weights come back on resume (like SGLang's flag); else a refit must load them",
    )
    p.add_argument(
        "--inject-latency-ms", type=float, default=0.0, help="mean injected delay in ms (default 0)"
    )
    p.add_argument(
        "--inject-latency-fraction", type=float, default=0.0, help="fraction of requests delayed (default 0)"
    )
    p.add_argument("--inject-latency-seed", type=int, default=0, help="seed of the injected delays")
    p.add_argument("--served-model-name", dest="model_name", default=None, help="model id of the OpenAI API")
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "qwen25"],
        help="parse <tool_call> blocks in chat",
    )
    p.add_argument(
        "--max-request-tokens",
        type=int,
        default=DEFAULT_MAX_REQUEST_TOKENS,
        help=(
            "bound of one /generate call: sum of n x (prompt + max_new_tokens); 0 = none "
            f"(default {DEFAULT_MAX_REQUEST_TOKENS})"
        ),
    )
    p.add_argument(
        "--max-request-sequences",
        type=int,
        default=DEFAULT_MAX_REQUEST_SEQUENCES,
        help=f"bound of one /generate call: prompts x n; 0 = none (default {DEFAULT_MAX_REQUEST_SEQUENCES})",
    )
    p.add_argument("--speculative", default=None, help=_SPECULATIVE_HELP)
    p.add_argument("--exact-on-policy", action="store_true", help=_EXACT_HELP)
    p.add_argument("--log-level", default="warning", help="logging level (default warning)")
    add_lora_args(p)
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, load the model, serve until SIGINT/SIGTERM."""
    args = make_parser().parse_args(argv)
    if not 0 <= args.inject_latency_fraction <= 1:
        raise SystemExit(f"--inject-latency-fraction must be in [0, 1], got {args.inject_latency_fraction}")
    if not Path(args.model).is_dir():
        raise SystemExit(
            f"verst serve: --model {args.model!r} is not a directory; give a Hugging Face model folder"
        )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from verst.rollout.engines.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine.from_pretrained(
        args.model,
        device=args.device,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        num_threads=args.num_threads,
        max_batch_size=args.max_batch_size,
        context_len=args.context_length,
        weight_version=args.weight_version or 0,
        speculative=args.speculative,
    )
    if args.exact_on_policy:  # reported in /server_info with the other arguments
        try:
            engine.enable_exact_on_policy()
        except ValueError as exc:
            raise SystemExit(f"verst serve: --exact-on-policy: {exc}") from None
    from verst.rollout.engines.serve.lora_http import configure as configure_lora

    for name, path in configure_lora(engine, args):
        asyncio.run(engine.load_lora_adapter(name, path))
    info = {k: v for k, v in vars(args).items() if k != "log_level"}
    info["model_path"], info["tokenizer_path"] = args.model, args.tokenizer or args.model
    latency = LatencyInjection(args.inject_latency_ms, args.inject_latency_fraction, args.inject_latency_seed)
    app = build_app(
        engine,
        latency=latency,
        info=info,
        max_request_tokens=args.max_request_tokens or None,
        max_request_sequences=args.max_request_sequences or None,
    )
    print(f"verst serve: {args.model} on http://{args.host}:{args.port}", flush=True)
    web.run_app(
        app, host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
    )
    _exit_now()


def _exit_now() -> None:
    """Leave at once once the app's cleanup has closed the engine: tearing down the interpreter
    (a heap of finished requests, torch) took seconds of a SIGTERM's few; nothing is left to run."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
