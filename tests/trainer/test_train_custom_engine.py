"""A new engine is one class (with its own config) and an import path in TOML.

`LoopEngine` below is a complete, if slow, backend written here: a Hugging Face causal LM
sampled token by token without a KV cache, which takes new weights only from a checkpoint
directory. `[engine] type = "test_train_custom_engine:LoopEngine"` selects it with its own typed
fields; a run trains through it for a few steps (weights reach it by 'disk', the mode its
capabilities prefer); and what it does not support (tensor weight sync, Ray engine actors) is
reported by config validation, from its declared capabilities, before anything loads.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Literal

import pytest
import torch
from pydantic import Field
from train_testlib import run_dict, write_prompts

from verst.rollout.engine import EngineCapabilities, GenerateOutput, GenerateRequest, InferenceEngine
from verst.rollout.engines.config import EngineSection
from verst.rollout.errors import ConfigError
from verst.trainer.config import load_run_config, validate_run_config
from verst.trainer.run.controller import run_training
from verst.trainer.run.run_dir import to_toml

ENGINE_TYPE = f"{__name__}:LoopEngine"


class LoopEngine:
    """Samples with full forwards (no cache), one request at a time; weights from disk only."""

    class Config(EngineSection):
        """This engine's own `[engine]` fields."""

        type: str = Field(ENGINE_TYPE, description="This engine's import path.")
        compute_dtype: Literal["float32", "float64"] = Field(
            "float32", description="dtype of the model's forward."
        )
        label: str = Field("loop", description="A name for the engine (in its repr).")

        def capabilities(self) -> EngineCapabilities:
            return EngineCapabilities(needs_model_path=True, weight_sync=("disk",))

        async def build(self, *, max_concurrency: int) -> InferenceEngine:
            assert self.model_path is not None
            return await asyncio.to_thread(LoopEngine, self.model_path, self)

    def __init__(self, model_path: str, config: LoopEngine.Config) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.dtype = getattr(torch, config.compute_dtype)
        self.model = self._load(model_path)
        self.eos = AutoTokenizer.from_pretrained(model_path).eos_token_id
        self.version = 0
        self.disk_loads: list[str] = []
        self._lock = threading.Lock()  # one forward at a time

    def __repr__(self) -> str:
        return f"LoopEngine({self.config.label!r})"

    def _load(self, path: str) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).eval()

    def _sample(self, request: GenerateRequest) -> GenerateOutput:
        s = request.sampling
        gen = torch.Generator().manual_seed(s.sampling_seed or 0)
        ids, out, logps, reason = list(request.input_ids), [], [], "length"
        with self._lock, torch.no_grad():
            for _ in range(s.max_new_tokens):
                logits = self.model(torch.tensor([ids])).logits[0, -1].double()
                logp = torch.log_softmax(logits / (s.temperature or 1.0), -1)
                tok = (
                    int(logp.argmax())
                    if s.temperature == 0
                    else int(torch.multinomial(logp.exp(), 1, generator=gen))
                )
                ids.append(tok)
                out.append(tok)
                logps.append(float(logp[tok]))
                if tok == self.eos and not s.ignore_eos:
                    reason = "stop"
                    break
        return GenerateOutput(out, logps, reason, self.version, prompt_tokens=len(request.input_ids))

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        return await asyncio.to_thread(self._sample, request)

    async def abort(self, rid_prefix: str | None = None) -> None:
        return None  # requests are short and run to completion

    async def update_weights_from_tensors(
        self, named_tensors: dict, weight_version: int | None = None
    ) -> int:
        raise NotImplementedError("LoopEngine loads checkpoints only (its capabilities say so)")

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> int:
        model = await asyncio.to_thread(self._load, model_path)
        with self._lock:
            self.model = model
            self.version = self.version + 1 if weight_version is None else weight_version
        self.disk_loads.append(model_path)
        return self.version

    async def health(self) -> bool:
        return True

    async def get_weight_version(self) -> int:
        return self.version

    async def close(self) -> None:
        return None


def _write_config(tmp_path, tiny_checkpoint, **sections) -> Any:
    data = write_prompts(tmp_path / "p.jsonl", n=8)
    cfg = run_dict(tiny_checkpoint, data, **sections)
    cfg["engine"] = {"type": ENGINE_TYPE, "compute_dtype": "float64", "label": "mine"}
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg), encoding="utf-8")
    return path


def test_an_engine_from_an_import_path_trains(tmp_path, tiny_checkpoint):
    torch.set_num_threads(1)
    path = _write_config(tmp_path, tiny_checkpoint)
    cfg = load_run_config(path)
    assert type(cfg.engine) is LoopEngine.Config
    assert (cfg.engine.compute_dtype, cfg.engine.label) == ("float64", "mine")
    validate_run_config(cfg, {}, cuda_available=False)

    summary = run_training(cfg, tmp_path / "run", env={})
    assert summary.steps_done == 2 and summary.weight_version == 2
    assert (tmp_path / "run" / "weights" / "v2").is_dir()  # 'auto' = disk, the engine's preferred mode
    assert "train/loss" in summary.last_metrics
    # the resolved config (as `verst train` writes it) loads back with the engine's own fields
    (tmp_path / "resolved.toml").write_text(to_toml(cfg.model_dump(mode="json")), encoding="utf-8")
    assert load_run_config(tmp_path / "resolved.toml").engine == cfg.engine


def test_what_the_engine_cannot_do_is_a_config_error(tmp_path, tiny_checkpoint):
    path = _write_config(tmp_path, tiny_checkpoint)
    bad = load_run_config(
        path,
        [
            'train.weight_sync="tensors"',
            'run.placement="ray"',
            "run.ray.engine_actors=2",
            'run.ray.layout="disaggregated"',
        ],
    )
    with pytest.raises(ConfigError) as err:
        validate_run_config(bad, {}, cuda_available=False)
    got = {p.key: p for p in err.value.problems}
    assert set(got) == {"train.weight_sync", "run.ray.engine_actors"}
    assert "accepts disk" in got["train.weight_sync"].why and "'disk'" in got["train.weight_sync"].fix
    assert ENGINE_TYPE in got["run.ray.engine_actors"].why

    # its model path is required because its capabilities say it loads one
    no_model = load_run_config(path, ['train.model_path=""'])
    no_model.train.model_path = None
    with pytest.raises(ConfigError) as err:
        validate_run_config(no_model, {}, cuda_available=False)
    assert "engine.model_path" in [p.key for p in err.value.problems]


def test_its_fields_are_validated_like_any_section(tmp_path, tiny_checkpoint):
    path = _write_config(tmp_path, tiny_checkpoint)
    with pytest.raises(ConfigError) as err:
        load_run_config(path, ['engine.compute_dtype="int8"', "engine.labl=1"])
    got = {p.key: p for p in err.value.problems}
    assert "float64" in got["engine.compute_dtype"].why
    assert "engine.label" in got["engine.labl"].fix  # the closest of the engine's own keys
    with pytest.raises(ConfigError) as err:
        load_run_config(path, ['engine.type="trtllm"'])
    (problem,) = err.value.problems
    assert problem.key == "engine.type" and "sglang_launch" in problem.why and "import path" in problem.why
    with pytest.raises(ConfigError, match="has no attribute 'Nope'"):
        load_run_config(path, [f'engine.type="{__name__}:Nope"'])


def test_its_path_fields_resolve_against_the_config_folder(tmp_path, tiny_checkpoint, monkeypatch):
    from verst.trainer.cli import resolve_paths

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(tiny_checkpoint)
    path = _write_config(tmp_path, tiny_checkpoint)
    monkeypatch.chdir(tiny_checkpoint.parent)  # somewhere else
    relative = ['engine.model_path="models/tiny"', 'rollout.data.path="p.jsonl"']
    cfg = resolve_paths(load_run_config(path, relative), path)
    assert cfg.engine.model_path == str(tmp_path / "models" / "tiny")  # a variant's own config
    assert cfg.rollout.data.path == str(tmp_path / "p.jsonl")
