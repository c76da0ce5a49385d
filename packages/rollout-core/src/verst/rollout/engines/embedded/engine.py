"""The embedded engine: a Hugging Face causal LM served in-process, with continuous batching.

Concurrent `generate` calls are queued; one dedicated worker thread owns the model and runs the
decode loop (`loop.DecodeLoopMixin` stepping a `batch.DecodeBatch` on transformers'
`DynamicCache`), admitting queued requests between decode steps, so the event loop never blocks
on a forward pass. Aborts, pauses and
weight updates are applied between steps. Needs the `local` extra (torch, transformers).

    engine = EmbeddedEngine.from_pretrained("path/to/model", device="cpu")
    out = await engine.generate(GenerateRequest(input_ids=[...], sampling=SamplingParams(...)))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import threading
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path
from typing import Any

from verst.rollout.engine import EngineCapabilities, EngineError, GenerateOutput, GenerateRequest
from verst.rollout.engines.common.errors import InvalidRequest, new_rid, require
from verst.rollout.engines.embedded.loop import DecodeLoopMixin, Handle, deliver_final
from verst.rollout.engines.embedded.lora import LoraEngineMixin

LOCAL_FEATURE = "the embedded engine"

_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _speculative(config: Any, model: Any, vocab: int) -> Any:
    """The decode batch's `SpeculativeDecoder` for an `engine.speculative` config (None: off)."""
    from verst.rollout.engines.embedded.speculative.config import parse_speculative

    section = parse_speculative(config)
    if not section.enabled:
        return None
    from verst.rollout.engines.embedded.speculative.gate import CostGate
    from verst.rollout.engines.embedded.speculative.step import SpeculativeDecoder

    gate = CostGate(verify_cost=section.verify_cost) if section.gate == "auto" else None
    return SpeculativeDecoder(section.build(model, vocab), section.num_tokens, gate=gate)


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class EmbeddedEngine(DecodeLoopMixin, LoraEngineMixin):
    """An `InferenceEngine` running a causal LM in this process (CPU or GPU); serves LoRA
    adapters on top of its base weights (`LoraEngineMixin`)."""

    BATCH_WAIT_CAP = 10
    """An idle engine collects companions of a first request for at most this × `batch_wait_s`."""
    IDLE_RELEASE_S = 0.05
    """An engine idle this long hands its OpenMP workers back (`verst.rollout.openmp`); a shorter
    gap (the next turn of an agentic episode, a late request) keeps them."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        max_batch_size: int = 64,
        batch_wait_s: float = 0.002,
        context_len: int | None = None,
        model_path: str | None = None,
        weight_version: int = 0,
        prefix_sharing: bool = True,
        vision: Any = None,
        speculative: Any = None,
    ) -> None:
        """Serve `model` (a transformers causal LM, put in eval mode here).

        `tokenizer` is needed for stop strings and output text; `max_batch_size` caps the rows
        decoded together (more requests wait in the queue); `batch_wait_s` is how long an idle
        engine waits for companions of a first request before prefilling (restarted by each new
        arrival, at most `BATCH_WAIT_CAP` times in total); `prefix_sharing` prefills the requests
        of one admission that have the same prompt (and adapter, and images) once, copying the
        result to each; `vision` is the `MultimodalProcessor` of a vision-language model (requests
        with `images` need it); `speculative` is an `engine.speculative` config (a
        `speculative.config.SpeculativeSection`, a table or a name; None = off).
        """
        require("torch", extra="local", feature=LOCAL_FEATURE)
        from verst.rollout.engines.embedded.batch import DecodeBatch

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.context_len = int(context_len or getattr(cfg, "max_position_embeddings", 0) or 2048)
        self.vocab_size = int(cfg.vocab_size)
        self._eos = self._eos_ids()
        pad = getattr(tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else getattr(cfg, "pad_token_id", None)
        self._batch = DecodeBatch(model, int(pad or 0), tokenizer)
        self._batch.share_prefix = prefix_sharing
        self.vision = self._batch.vision = vision
        self._batch.speculative = _speculative(speculative, model, self.vocab_size)
        self._weight_version = weight_version
        self._cond = threading.Condition()
        self._pending: list[Any] = []
        self._aborts: list[tuple[Callable[[Any], bool], concurrent.futures.Future[None]]] = []
        self._cancelled: list[Any] = []
        self._commands: list[tuple[Callable[[], int], concurrent.futures.Future[int]]] = []
        self._paused = False
        self._closed = False
        self._device = self._batch.device
        self.released = False
        """Device memory is released (`release_memory`); the next request takes it back."""
        self.peak_batch = 0
        """The most rows decoded together so far (a batching statistic)."""
        self._thread = threading.Thread(target=self._run, name="verst-embedded-engine", daemon=True)
        self._thread.start()

    @property
    def capabilities(self) -> EngineCapabilities:
        """In this process (weights go over as tensors), on its device, memory releasable."""
        return EngineCapabilities(
            in_process=True,
            uses_gpu=self._device.type == "cuda",
            needs_model_path=True,
            weight_sync=("tensors", "disk"),
            release_memory=True,
            ray_engine_actors=True,
            lora=True,
            routing_replay=True,
            weight_dtype=self.weight_dtype,
            partial_weights=True,
        )

    def enable_exact_on_policy(self) -> None:
        """`train.exact_on_policy`: decode on the batch-invariant ops and report the trainer's
        log-probs bit for bit (`embedded.exact`); before the first request."""
        from verst.rollout.engines.embedded.exact import enable_exact

        enable_exact(self._batch)

    @property
    def weight_dtype(self) -> str:
        """The dtype of the model's floating weights ('float32', 'bfloat16', ...)."""
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    async def replica_states(self) -> list[tuple[str, int, int]]:
        """This engine (its identity within the process) at its version (`common.replicas`)."""
        return [("embedded", id(self), self._weight_version)]

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        tokenizer: Any = None,
        num_threads: int | None = None,
        **kwargs: Any,
    ) -> EmbeddedEngine:
        """Load a model (and its tokenizer, unless given as an object or a path) from a directory."""
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        torch = require("torch", extra="local", feature=LOCAL_FEATURE)
        transformers = require("transformers", extra="local", feature=LOCAL_FEATURE)
        if num_threads:
            torch.set_num_threads(num_threads)
        from verst.rollout.multimodal.families import auto_model_class, is_vision_config

        model = (
            auto_model_class(str(path))
            .from_pretrained(str(path), dtype=dtype if dtype == "auto" else getattr(torch, dtype))
            .to(_resolve_device(device))
        )
        from verst.rollout.engines.embedded.attention import use_grouped_sdpa

        if tokenizer is None or isinstance(tokenizer, str | Path):
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer or path))
        if is_vision_config(model.config):
            from verst.rollout.multimodal.processor import MultimodalProcessor

            kwargs.setdefault("vision", MultimodalProcessor.from_pretrained(path, tokenizer, model.config))
        else:
            use_grouped_sdpa(model)  # the engine owns this model: grouped KV heads without copies
        return cls(model, tokenizer, model_path=str(path), **kwargs)

    # ---- the protocol ------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Generate (or score, with `max_new_tokens=0`) one request; batched with concurrent calls."""
        row, handle = self._submit(request, stream=False)
        try:
            return await handle.future
        except asyncio.CancelledError:
            self._cancel(row)
            raise

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[tuple[GenerateOutput, bool]]:
        """Yield `(output so far, finished)` after every decode step, ending with the final output."""
        row, handle = self._submit(request, stream=True)
        assert handle.stream is not None
        try:
            while True:
                out, final = await handle.stream.get()
                if final and handle.future.done() and handle.future.exception() is not None:
                    raise handle.future.exception()  # type: ignore[misc]
                yield out, final
                if final:
                    return
        finally:
            if not handle.future.done():
                self._cancel(row)

    async def abort(self, rid_prefix: str | None = None) -> None:
        """Abort matching requests (all when None); they return partial output with finish abort."""
        await asyncio.wrap_future(
            self._abort_nowait(lambda r: rid_prefix is None or r.request.rid.startswith(rid_prefix))
        )

    async def abort_rids(self, rids: Collection[str]) -> None:
        """Abort the requests whose id is exactly one of `rids` (SGLang's /abort_request)."""
        wanted = set(rids)
        await asyncio.wrap_future(self._abort_nowait(lambda r: r.request.rid in wanted))

    @property
    def device_type(self) -> str:
        """`cpu` or `cuda`: where the model runs."""
        return self._device.type

    async def update_weights_from_tensors(
        self, named_tensors: dict[str, Any], weight_version: int | None = None
    ) -> int:
        """Copy the given tensors into the model between decode steps; returns the new version."""
        return await asyncio.wrap_future(self._command(lambda: self._load(named_tensors, weight_version)))

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> int:
        """Load a checkpoint directory (read off the worker thread), then apply it between steps."""
        if not Path(model_path).is_dir():
            raise InvalidRequest(f"update_weights_from_disk: {model_path!r} is not a directory")
        state = await asyncio.to_thread(self._read_checkpoint, model_path)
        version = await self.update_weights_from_tensors(state, weight_version)
        self.model_path = model_path
        return version

    async def health(self) -> bool:
        """True while the worker thread is alive and the engine is open."""
        return not self._closed and self._thread.is_alive()

    async def get_weight_version(self) -> int:
        """The current weight version."""
        return self._weight_version

    async def close(self, timeout_s: float = 30.0) -> None:
        """Stop the worker; requests still queued or running finish with `abort`.

        Waits at most `timeout_s` for the worker to finish its current step (a server shutting
        down passes a short bound: the worker is a daemon thread and never holds the exit up)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        await asyncio.to_thread(self._thread.join, timeout_s)

    # ---- control used by the server ---------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The current weight version (synchronous read)."""
        return self._weight_version

    def pause(self) -> None:
        """Stop decoding (in place: running requests keep their state); new ones wait."""
        with self._cond:
            self._paused = True
            self._cond.notify_all()

    def resume(self) -> None:
        """Resume decoding after `pause`."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        """Whether decoding is paused."""
        return self._paused

    def flush_cache(self) -> bool:
        """Nothing is cached across requests; succeeds when idle or paused (as SGLang's does)."""
        return self._paused or not (len(self._batch) or self._pending)

    async def release_memory(self) -> None:
        """Free device memory for a colocated train step: drop the KV cache (running requests end
        with `abort`) and, on CUDA, move the weights to CPU and empty the allocator's cache. On
        CPU only the KV cache goes (weights stay: there is no other memory to move them to).
        Weight updates still apply while released; `resume_memory` (or the next request) takes
        the memory back."""
        await asyncio.wrap_future(self._command(self._release_now))

    async def resume_memory(self) -> None:
        """Take back what `release_memory` freed (weights back on the device); idempotent."""
        await asyncio.wrap_future(self._command(self._resume_now))

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """SGLang's name for `release_memory` (every tag: the weights are backed up on CPU)."""
        await self.release_memory()

    async def resume_memory_occupation(
        self, tags: list[str] | None = None, *, continue_generation: bool = True
    ) -> None:
        """SGLang's name for `resume_memory` (everything comes back at once)."""
        await self.resume_memory()

    def _release_now(self) -> int:
        import torch

        self._emit_all(self._batch.drop_all("abort"))
        self._batch.cache = None
        if self._device.type == "cuda" and not self.released:
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.released = True
        return self._weight_version

    def _resume_now(self) -> int:
        if self.released and self._device.type == "cuda":
            self.model.to(self._device)
        self.released = False
        return self._weight_version

    @property
    def prefill_stats(self) -> dict[str, int]:
        """Prefill statistics so far: `rows` admitted, prompt `tokens` run through prefill, and
        prompt tokens `saved` by rows sharing an identical prompt's prefill (`prefix_sharing`)."""
        b = self._batch
        return {"rows": b.prefill_rows, "tokens": b.prefill_tokens, "saved": b.prefill_tokens_saved}

    @property
    def speculative_stats(self) -> dict[str, float] | None:
        """Speculative decoding's counters so far (`speculative.step.SpeculativeStats`); None: off."""
        spec = self._batch.speculative
        return None if spec is None else spec.stats.as_dict()

    @property
    def prefill_tokens_saved(self) -> int:
        """Prompt tokens not prefilled because their row shared an identical prompt's prefill."""
        return self._batch.prefill_tokens_saved

    def load(self) -> dict[str, int]:
        """Running and waiting request counts (for `/v1/loads`)."""
        return {"num_running_reqs": len(self._batch), "num_waiting_reqs": len(self._pending)}

    # ---- internals ---------------------------------------------------------------------------
    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(self.tokenizer, "eos_token_id", None), self._gen_eos()):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list | tuple):
                ids.update(int(i) for i in source)
        return frozenset(ids)

    def _gen_eos(self) -> Any:
        gen = getattr(self.model, "generation_config", None)
        return getattr(gen, "eos_token_id", None) if gen is not None else None

    def _validate(self, request: GenerateRequest) -> GenerateRequest:
        s = request.sampling
        ids = request.input_ids
        problems = []
        if not ids:
            problems.append("input_ids is empty")
        elif not all(isinstance(i, int) and 0 <= i < self.vocab_size for i in ids):
            problems.append(f"input_ids must be ints in [0, {self.vocab_size})")
        elif len(ids) > self.context_len:
            problems.append(
                f"the prompt has {len(ids)} tokens, more than the context length {self.context_len}"
            )
        if ids and request.images:
            from verst.rollout.engines.embedded.vision import image_problem

            bad_image = image_problem(self.vision, ids, request.images)
            if bad_image:
                problems.append(bad_image)
        if s.max_new_tokens < 0:
            problems.append(f"max_new_tokens must be >= 0, got {s.max_new_tokens}")
        if not (math.isfinite(s.temperature) and s.temperature >= 0):  # NaN fails every comparison
            problems.append(f"temperature must be a finite number >= 0, got {s.temperature}")
        if not 0 < s.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {s.top_p}")
        if s.top_k == 0 or s.top_k < -1:
            problems.append(f"top_k must be -1 (all) or >= 1, got {s.top_k}")
        if s.stop and self.tokenizer is None:
            problems.append("stop strings need a tokenizer; pass one to the engine or use stop_token_ids")
        if s.sampling_seed is not None and not -(2**63) <= s.sampling_seed < 2**64:
            problems.append(f"sampling_seed must fit in 64 bits, got {s.sampling_seed}")
        if request.top_logprobs_num < 0:
            problems.append(f"top_logprobs_num must be >= 0, got {request.top_logprobs_num}")
        if request.token_ids_logprob and not all(0 <= i < self.vocab_size for i in request.token_ids_logprob):
            problems.append(f"token_ids_logprob must be ids in [0, {self.vocab_size})")
        if problems:
            raise InvalidRequest("invalid generate request: " + "; ".join(problems))
        return request if request.rid else dataclasses.replace(request, rid=new_rid())

    def _submit(self, request: GenerateRequest, *, stream: bool) -> tuple[Any, Handle]:
        from verst.rollout.engines.embedded.batch import Row
        from verst.rollout.engines.embedded.sampling import RowSampling

        request = self._validate(request)
        s = request.sampling
        stop_ids = frozenset(s.stop_token_ids) | (frozenset() if s.ignore_eos else self._eos)
        row = Row(
            request, RowSampling(s.temperature, s.top_p, s.top_k, s.sampling_seed), stop_ids, self.context_len
        )
        loop = asyncio.get_running_loop()
        handle = Handle(loop, loop.create_future(), asyncio.Queue() if stream else None)
        row.handle = handle
        with self._cond:
            if self._closed:
                raise EngineError("the embedded engine is closed; create a new one")
            self._pending.append(row)
            self._cond.notify_all()
        return row, handle

    def _abort_nowait(self, match: Callable[[Any], bool]) -> concurrent.futures.Future[None]:
        """Abort the matching requests: queued ones are answered here, all of them with one
        wake-up of each caller's loop (a queue of thousands must not cost a wake-up each);
        running ones by the worker between steps (the returned future is set then)."""
        ack: concurrent.futures.Future[None] = concurrent.futures.Future()
        queued: list[Any] = []
        kept: list[Any] = []
        with self._cond:
            for r in self._pending:
                (queued if match(r) else kept).append(r)
            self._pending = kept
            self._aborts.append((match, ack))
            self._cond.notify_all()
        if queued:  # never admitted: nothing was computed, the answer is the same cheap one for each
            version = self._weight_version
            deliver_final(
                [(r.handle, GenerateOutput([], [], "abort", version, r.prompt_len)) for r in queued]
            )
        return ack

    def _cancel(self, row: Any) -> None:
        """Drop the row of a caller that stopped waiting (cancelled, or a stream closed early).

        Nobody reads its answer, so nothing is delivered; the worker drops all rows cancelled
        since its last step in one pass over the queue (thousands of cancelled callers cost one
        pass, not one each)."""
        with self._cond:
            self._cancelled.append(row)
            self._cond.notify_all()

    def _command(self, fn: Callable[[], int]) -> concurrent.futures.Future[int]:
        fut: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise EngineError("the embedded engine is closed")
            self._commands.append((fn, fut))
            self._cond.notify_all()
        return fut

    def _read_checkpoint(self, path: str) -> dict[str, Any]:
        require("transformers", extra="local", feature=LOCAL_FEATURE)
        dtype = next(self.model.parameters()).dtype
        try:
            from verst.rollout.multimodal.families import auto_model_class

            fresh = auto_model_class(path).from_pretrained(path, dtype=dtype)
        except Exception as exc:
            raise InvalidRequest(f"update_weights_from_disk: cannot load {path!r}: {exc}") from exc
        return fresh.state_dict()

    def _load(self, named: dict[str, Any], version: int | None) -> int:
        import torch

        state = self.model.state_dict()
        unknown = [n for n in named if n not in state]
        bad = [n for n in named if n in state and tuple(named[n].shape) != tuple(state[n].shape)]
        if unknown or bad:
            raise InvalidRequest(
                f"weight update rejected: unknown names {unknown[:5]}, shape mismatches {bad[:5]} "
                f"(names must be the model's state_dict keys)"
            )
        with torch.no_grad():
            for name, tensor in named.items():
                state[name].copy_(tensor)
        if self._batch.speculative is not None:
            self._batch.speculative.proposer.refit(named)  # a draft with `refit = "with_policy"`
        self._weight_version = self._weight_version + 1 if version is None else int(version)
        return self._weight_version
