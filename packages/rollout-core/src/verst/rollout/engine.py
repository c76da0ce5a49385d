"""The `InferenceEngine` protocol and the plain data it exchanges.

Two implementations: the embedded engine (`verst.rollout.engines.embedded.engine`, an in-process torch
model) and the SGLang HTTP client (`verst.rollout.engines.sglang.client`), which talks to real
SGLang servers or routers and to `verst serve`. Rollout strategies only see this protocol.

What an engine can do beyond it is asked, never guessed from its class or type name: optional
methods are small runtime-checkable protocols (`MemoryReleasable`, `DistributedWeightReceiver`),
and `EngineCapabilities` (declared by each engine's config, and by engine objects that the
trainer may be handed directly) says where it runs and which weight-sync modes it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from verst.rollout.errors import RolloutError

if TYPE_CHECKING:
    from verst.rollout.moe import RoutedExperts

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings for one request (SGLang's `sampling_params`)."""

    max_new_tokens: int = 128
    """Maximum number of tokens to generate; 0 only scores the prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 = all."""
    stop: tuple[str, ...] = ()
    """Stop strings (kept in the output, as RL clients send `no_stop_trim=True`)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop token ids (the tokenizer's EOS always stops unless `ignore_eos`)."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    sampling_seed: int | None = None
    """Seed for reproducible sampling of this request."""

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (params are immutable; each call gets its own)."""
        return replace(self, **changes)

    def to_sglang(self) -> dict[str, Any]:
        """The `sampling_params` dict of SGLang's /generate."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "ignore_eos": self.ignore_eos,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
            "skip_special_tokens": False,
        }
        return {**out, **self.stops_and_seed("sampling_seed")}

    def stops_and_seed(self, seed_key: str) -> dict[str, Any]:
        """`stop`, `stop_token_ids` and the seed (as `seed_key`), each only when set: the part of
        a wire `sampling_params` that SGLang's and vLLM's share."""
        out: dict[str, Any] = {}
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.sampling_seed is not None:
            out[seed_key] = self.sampling_seed
        return out


@dataclass(slots=True)
class GenerateRequest:
    """One generation (or scoring) request to an engine."""

    input_ids: list[int]
    """Prompt token ids."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling settings."""
    rid: str = ""
    """Request id; abort matches ids by prefix. Empty = the engine assigns one."""
    return_logprob: bool = True
    """Return the log-prob of every generated token."""
    top_logprobs_num: int = 0
    """Also return the top-k log-probs at every position (output, and input if scored)."""
    logprob_start_len: int = -1
    """-1 = output log-probs only; 0 = also every prompt position (teacher scoring)."""
    token_ids_logprob: list[int] | None = None
    """Also return the log-probs of these token ids at every position."""
    lora_path: str | None = None
    """The LoRA adapter to generate with, by its loaded name (SGLang's field name); None = base."""
    return_routed_experts: bool = False
    """Also return each MoE layer's chosen experts per position (SGLang's field name; engines
    with the `routing_replay` capability)."""
    routed_experts_start_len: int = 0
    """First position whose routing is returned (SGLang's; 0 = the whole sequence)."""
    images: tuple[Any, ...] = ()
    """One `verst.rollout.multimodal.PromptImage` per image in `input_ids` (already expanded;
    offsets index `input_ids`), in order. Empty = a text-only prompt."""


@dataclass(slots=True)
class GenerateOutput:
    """What an engine returns for one request."""

    output_ids: list[int]
    """Generated token ids (the stop token included)."""
    output_logprobs: list[float]
    """`log_softmax(logits / temperature)` of each generated token (empty if not asked)."""
    finish_reason: FinishReason
    """stop (stop token/string), length (max tokens/context), abort (partial output)."""
    weight_version: int
    """The engine's weight version when the request finished."""
    prompt_tokens: int = 0
    """Number of prompt tokens."""
    text: str = ""
    """Decoded output (when the engine has a tokenizer)."""
    input_logprobs: list[float | None] | None = None
    """Per prompt position (first is None), when `logprob_start_len == 0`."""
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    """Per output position, the top-k (log-prob, token id) pairs."""
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    """Per prompt position, the top-k (log-prob, token id) pairs (first is None)."""
    output_token_ids_logprobs: list[list[tuple[float, int]]] | None = None
    """Per output position, the log-probs of `token_ids_logprob`."""
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    """Per prompt position, the log-probs of `token_ids_logprob` (first is None)."""
    routed_experts: RoutedExperts | None = None
    """With `return_routed_experts`: the experts chosen at positions `[routed_experts_start_len,
    prompt + output - 1)` (`verst.rollout.moe`); None from a dense model or an engine that
    cannot record them."""
    output_token_versions: list[int] | None = None
    """Per output token, the weight version that sampled it, when the engine reports it per token
    (vLLM's `weight_versions` spans: a request paused across a refit changes version mid-way);
    None = every token has `weight_version`."""

    @property
    def completion_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.output_ids)


class EngineError(RuntimeError):
    """An engine failed in a way the caller should surface (after any retries)."""

    retryable: bool = True
    """Whether trying the same request again may succeed (a connection error, a 5xx / 503);
    False for a request the engine refuses (a 4xx), which a strategy marks FAILED at once."""


class EngineTimeout(EngineError, RolloutError):
    """An engine call ran past its bound from the config (no answer, half a body, a refit that
    stalls); the message is one line naming the engine, the route and the bound. Not retried:
    a rollout stops at once (it is a `RolloutError`) and so does a weight sync."""

    retryable = False


@runtime_checkable
class InferenceEngine(Protocol):
    """An inference engine a rollout sends requests to.

    Narrow on purpose: a strategy needs to generate, abort, know the weight version and check
    health; the trainer additionally pushes weights. Everything is async so that one event loop
    drives many concurrent requests.
    """

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Generate (or score, with `max_new_tokens=0`) one request."""
        ...

    async def abort(self, rid_prefix: str | None = None) -> None:
        """Abort in-flight requests whose id starts with `rid_prefix`, or all when None.

        Aborted requests return their partial output with finish reason `abort`.
        """
        ...

    async def update_weights_from_tensors(
        self, named_tensors: dict[str, Any], weight_version: int | None = None
    ) -> int:
        """Load new weights from in-memory tensors; returns the new weight version."""
        ...

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> int:
        """Load new weights from a checkpoint directory; returns the new weight version."""
        ...

    async def health(self) -> bool:
        """True when the engine can serve requests."""
        ...

    async def get_weight_version(self) -> int:
        """The current weight version (starts at 0, +1 per update unless given)."""
        ...

    async def close(self) -> None:
        """Release resources (HTTP sessions, threads)."""
        ...


@runtime_checkable
class MemoryReleasable(Protocol):
    """An engine that can free its device memory while training runs (colocated layouts)."""

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free device memory until `resume_memory_occupation`: SGLang's `tags` ("weights",
        "kv_cache", "cuda_graph"; None = all). Engines that cannot free selectively free all."""
        ...

    async def resume_memory_occupation(
        self, tags: list[str] | None = None, *, continue_generation: bool = True
    ) -> None:
        """Take back `tags` (None = all) of what was freed; continue generation unless told not to."""
        ...


@runtime_checkable
class LoraAdapterServer(Protocol):
    """An engine that serves LoRA adapters on its base weights (SGLang's LoRA API)."""

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, weight_version: int | None = None
    ) -> int:
        """Load (or replace) an adapter from a PEFT directory; returns the weight version."""
        ...

    async def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        tensors: dict[str, Any],
        config_dict: dict[str, Any],
        *,
        weight_version: int | None = None,
    ) -> int:
        """Load (or replace) an adapter from PEFT-named tensors; returns the weight version."""
        ...

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unload an adapter."""
        ...


@dataclass(frozen=True, slots=True)
class WeightGroupSpec:
    """A weight-update group to join, in the fields (and order) of SGLang 0.5.23's
    `/init_weights_update_group` body (`InitWeightsUpdateGroupReqInput`): `asdict(spec)` is it."""

    master_address: str
    """Host of the group's store (the trainer, rank 0), as the engines see it."""
    master_port: int
    """Port of that store."""
    rank_offset: int
    """The first rank this member takes (the trainer: 0; an engine's workers count up from it)."""
    world_size: int
    """Members in total: the trainer plus every engine rank."""
    group_name: str
    """The group's name (also its store prefix)."""
    backend: str = "nccl"
    """`nccl` (GPU) or `gloo` (CPU)."""


@dataclass(frozen=True, slots=True)
class WeightBucket:
    """The tensors of one `update_weights_from_distributed` call, broadcast from rank 0 in this
    order (SGLang 0.5.23's `UpdateWeightsFromDistributedReqInput` fields of the same names)."""

    names: list[str]
    """Parameter names."""
    dtypes: list[str]
    """Their dtypes, torch's names without `torch.` (`"bfloat16"`)."""
    shapes: list[list[int]]
    """Their shapes."""
    group_name: str
    """The weight-update group they come through."""


@runtime_checkable
class DistributedWeightReceiver(Protocol):
    """An engine in another process that receives weights by broadcast over a weight group.

    SGLang 0.5.23's shape: the engine's workers take `weight_group_ranks()` ranks from
    `group.rank_offset`; a push is one session (`begin_weight_update` … `end_weight_update`) of
    `update_weights_from_distributed_bucket` calls, each received while the trainer broadcasts.
    """

    async def weight_group_ranks(self) -> int:
        """Ranks this engine's workers take in the group (Σ of their GPUs)."""
        ...

    async def begin_weight_update(self) -> None:
        """Pause, flush, and open a weight-update session on every worker."""
        ...

    async def update_weights_from_distributed_bucket(
        self, bucket: WeightBucket, *, weight_version: int | None = None, flush_cache: bool = False
    ) -> None:
        """Receive one bucket (one broadcast per tensor) inside the open session."""
        ...

    async def end_weight_update(self, weight_version: int | None, *, check: bool = True) -> None:
        """Close the session, check the version, continue generation."""
        ...

    async def init_weights_update_group(self, group: WeightGroupSpec) -> None:
        """Join the trainer's weight-update group (the trainer is rank 0)."""
        ...

    async def update_weights_from_distributed(
        self, bucket: WeightBucket, weight_version: int | None = None
    ) -> int:
        """A whole push in one bucket and one session; returns the new weight version."""
        ...


WeightSyncMode = Literal["tensors", "disk", "distributed"]


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What an engine can do; validation and the trainer ask this instead of the engine's type.

    The defaults describe the least an engine offers: out of process, CPU, loads weights from a
    checkpoint directory, nothing else."""

    in_process: bool = False
    """The engine lives in this process (shares its memory; weights go over as tensors)."""
    uses_gpu: bool = False
    """It computes on a GPU where the rollout manager runs (placement reserves one)."""
    needs_model_path: bool = False
    """It loads a model itself, so `model_path` (or the trainer's model) must be known."""
    weight_sync: tuple[WeightSyncMode, ...] = ("disk",)
    """Weight-sync modes it accepts, preferred first (`train.weight_sync = 'auto'` = the first)."""
    release_memory: bool = False
    """It can free device memory while training runs (`MemoryReleasable`)."""
    ray_engine_actors: bool = False
    """It can run as `run.ray.engine_actors` (one copy per Ray actor)."""
    engine_count: int | None = 1
    """Engine processes behind it (None = unknown, e.g. a router)."""
    launched_gpus: int = 0
    """GPUs of the server processes it starts for the run (0 = it starts none)."""
    lora: bool = False
    """It can serve LoRA adapters."""
    routing_replay: bool = False
    """It returns the MoE experts it chose per token (`return_routed_experts`), which
    `train.moe.routing_replay = 'rollout'` needs."""
    weight_dtype: str | None = None
    """The dtype it holds its weights in ('float32', 'bfloat16', 'float16'; None = not known
    here): the trainer casts float32 weights to a narrower one before sending them (the engine
    would cast them anyway)."""
    partial_weights: bool = False
    """A tensor refit may carry only some of its weights (the others stay as they are): the
    trainer then sends frozen weights once, not every push."""


def engine_capabilities(engine: Any) -> EngineCapabilities:
    """An engine object's capabilities: its `capabilities` attribute when it declares one, else
    what its methods show (an undeclared engine is assumed out of process)."""
    declared = getattr(engine, "capabilities", None)
    if isinstance(declared, EngineCapabilities):
        return declared
    modes: tuple[WeightSyncMode, ...] = ("disk", "tensors")
    if isinstance(engine, DistributedWeightReceiver):
        modes += ("distributed",)
    return EngineCapabilities(
        weight_sync=modes,
        release_memory=isinstance(engine, MemoryReleasable),
        lora=isinstance(engine, LoraAdapterServer),
    )
