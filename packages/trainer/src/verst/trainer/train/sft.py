"""Supervised fine-tuning (SFT) for warm starts: loss on response tokens only.

RL selects behaviours a policy can already sample; a short SFT run gives a tiny or base model
such behaviours. `verst sft CONFIG.toml` runs `run_sft`; the config is an `SftConfig` (TOML
with the fields below at the top level or under `[sft]`). Rows are JSONL objects holding a
prompt (text) and a response (text); the response is followed by the tokenizer's EOS so the
model learns to stop. The loss is the mean cross-entropy over response tokens (prompt
positions are ignored), AdamW, constant learning rate, batches drawn from a seeded shuffle.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from verst.rollout.errors import ConfigError, DataError, Problem


class SftConfig(BaseModel):
    """Settings of one SFT run."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model_path: str = Field(
        description="Hugging Face checkpoint directory (model + tokenizer) to start from."
    )
    data_path: str = Field(description="JSONL file of {prompt, response} rows.")
    output_dir: str = Field(description="Where the fine-tuned checkpoint (model + tokenizer) is written.")
    prompt_key: str = Field("prompt", description="Row key holding the prompt text.")
    response_key: str = Field("response", description="Row key holding the target response text.")
    apply_chat_template: bool = Field(
        False, description="Render the prompt as a user message with the tokenizer's chat template."
    )
    steps: int = Field(600, ge=1, description="Optimizer steps.")
    batch_size: int = Field(64, ge=1, description="Rows per step.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate (constant).")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    seed: int = Field(0, description="Seed of the data order and of torch.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None = torch's default).")
    log_every: int = Field(50, ge=1, description="Log the loss every N steps.")


def load_sft_config(path: str | Path, overrides: dict[str, Any] | None = None) -> SftConfig:
    """Read an SFT TOML (top level or `[sft]`); relative paths resolve against the file's folder."""
    import tomllib

    path = Path(path)
    raw = tomllib.loads(path.read_text())
    raw = dict(raw.get("sft", raw))
    raw.update(overrides or {})
    for key in ("model_path", "data_path", "output_dir"):
        if key in raw and not Path(raw[key]).is_absolute():
            raw[key] = str((path.parent / raw[key]).resolve())
    return SftConfig.model_validate(raw)


def sft_problems(cfg: SftConfig) -> list[Problem]:
    """Every problem of the run's paths, before anything loads: `model_path` must be a model
    directory (config.json + weights) or a Hub id, `data_path` an existing file."""
    from verst.trainer.config_checks import model_path_problems

    problems = model_path_problems("model_path", cfg.model_path)
    data = Path(cfg.data_path)
    if not data.is_file():
        why = "is a directory, not a JSONL file" if data.is_dir() else "not found"
        problems.append(
            Problem(
                "data_path", f"{cfg.data_path!r} {why}", "point it at a JSONL file of {prompt, response} rows"
            )
        )
    return problems


def _read_rows(cfg: SftConfig) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    with open(cfg.data_path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append((row[cfg.prompt_key], row[cfg.response_key]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise DataError(
                    f"{cfg.data_path}:{lineno}: expected a JSON object with keys "
                    f"{cfg.prompt_key!r} and {cfg.response_key!r} ({exc!r})"
                ) from exc
    if not rows:
        raise DataError(f"{cfg.data_path}: no rows")
    return rows


def _encode(tokenizer: Any, cfg: SftConfig, prompt: str, response: str) -> tuple[list[int], int]:
    """Token ids of prompt + response + EOS, and the number of prompt tokens."""
    if cfg.apply_chat_template:
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True
        )
        if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
        prompt_ids = list(prompt_ids)
    else:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    return [*prompt_ids, *response_ids, tokenizer.eos_token_id], len(prompt_ids)


def _draw(encoded: list[Any], order: list[int], rng: random.Random, size: int) -> list[Any]:
    """The next `size` examples of shuffled passes over `encoded` (`order`: what this pass has left)."""
    batch = []
    for _ in range(size):
        if not order:
            order.extend(range(len(encoded)))
            rng.shuffle(order)
        batch.append(encoded[order.pop()])
    return batch


def _collate(batch: list[tuple[list[int], int]], pad: int) -> tuple[Any, Any, Any]:
    """Right-padded `(input_ids, attention_mask, labels)` `[batch, seq]`; labels -100 on prompts and padding."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)  # [batch, seq]
    labels = torch.full((len(batch), width), -100, dtype=torch.long)  # [batch, seq]
    attention = torch.zeros((len(batch), width), dtype=torch.long)  # [batch, seq]
    for i, (ids, n_prompt) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
        attention[i, : len(ids)] = 1
    return input_ids, attention, labels


def run_sft(cfg: SftConfig, *, log: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, Any]:
    """Fine-tune `cfg.model_path` on `cfg.data_path`, save to `cfg.output_dir`; return a summary.
    Bad paths are one `ConfigError` (`sft_problems`) before the model loads."""
    problems = sft_problems(cfg)
    if problems:
        raise ConfigError(problems)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=torch.float32).to(device)
    model.train()
    encoded = [_encode(tokenizer, cfg, p, r) for p, r in _read_rows(cfg)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    order: list[int] = []
    start = time.perf_counter()
    losses: list[float] = []
    for step in range(1, cfg.steps + 1):
        input_ids, attention, labels = _collate(_draw(encoded, order, rng, cfg.batch_size), pad)
        out = model(
            input_ids=input_ids.to(device), attention_mask=attention.to(device), labels=labels.to(device)
        )
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        losses.append(out.loss.detach().item())
        if log is not None and (step % cfg.log_every == 0 or step == cfg.steps):
            window = losses[-cfg.log_every :]
            log(
                step,
                {
                    "sft/loss": sum(window) / len(window),
                    "sft/step_time_s": (time.perf_counter() - start) / step,
                },
            )
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    final = sum(losses[-cfg.log_every :]) / len(losses[-cfg.log_every :])
    return {
        "steps": cfg.steps,
        "final_loss": final if math.isfinite(final) else float("nan"),
        "seconds": time.perf_counter() - start,
        "output_dir": str(out_dir),
    }
