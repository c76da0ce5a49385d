"""Prompt datasets: JSONL and Parquet files of prompts, served as groups of `Sample`s.

`PromptDataSource` is the training `DataSource`: each epoch visits every prompt once in an
order shuffled with `seed + epoch`, groups handed back with `add_samples` are served first, and
`state_dict()` (epoch, offset, returned groups) restores it exactly, so a resumed run sees the
very prompts it would have seen. `load_prompt_samples` reads eval sets
(`verst.rollout.data_sources.build_eval_sets`).

A row is a JSON object (one per line) or a Parquet record. `input_key` holds the prompt: a
string, or chat messages (`[{"role": ..., "content": ...}]`); `label_key` the reference answer
(any JSON value; missing = None); `metadata_key` a dict copied into `sample.metadata`. A
malformed row raises `DataError` naming the file and the 1-based line (or row) and the fix.
"""

from __future__ import annotations

import json
import random
from collections import deque
from pathlib import Path
from typing import Any

from verst.rollout.config import DataConfig
from verst.rollout.errors import DataError, MissingOptionalDependency
from verst.rollout.sample import Sample, Status

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
"""File suffixes read as one JSON object per line."""
PARQUET_SUFFIXES = (".parquet", ".pq")
"""File suffixes read with pyarrow."""
STATE_VERSION = 1
"""Version of `PromptDataSource.state_dict()`'s layout."""


def _check_messages(prompt: list[Any]) -> str | None:
    """None if `prompt` is a list of chat messages, else what is wrong with it."""
    for i, msg in enumerate(prompt):
        if not isinstance(msg, dict):
            return f"message {i} is a {type(msg).__name__}, not an object"
        if not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            return f"message {i} needs string 'role' and 'content' fields (got keys {sorted(msg)})"
    return None


def _row_images(prompt: Any, row: dict[str, Any], config: DataConfig, where: str, path: Path | None) -> Any:
    """The row's images (chat image parts, then `image_key`): (prompt with placeholders, images)."""
    from verst.rollout.multimodal.rows import image_store_for, message_images, row_images

    store = image_store_for(path, config.image_dir) if path is not None else None
    base = path.parent if path is not None else None
    images = []
    if isinstance(prompt, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) for m in prompt
    ):
        prompt, images = message_images(prompt, where=where, store=store, base_dir=base)
    prompt, more = row_images(
        prompt, row.get(config.image_key), where=where, key=config.image_key, store=store, base_dir=base
    )
    return prompt, images + more


def _expand(
    prompt: Any,
    images: list[Any],
    config: DataConfig,
    where: str,
    tokenizer: Any,
    vision: Any,
    limit: int | None,
) -> tuple[list[int], list[dict[str, Any]]]:
    """A prompt with images → its model ids (image tokens expanded once, here) and recipes."""
    from verst.rollout.multimodal.rows import tokenize_with_images

    return tokenize_with_images(
        prompt,
        images,
        where=where,
        tokenizer=tokenizer,
        vision=vision,
        apply_chat_template=config.apply_chat_template,
        max_prompt_tokens=limit,
    )


def _row_to_sample(
    row: Any,
    config: DataConfig,
    where: str,
    tokenizer: Any,
    max_prompt_tokens: int | None = None,
    vision: Any = None,
    path: Path | None = None,
) -> Sample:
    """One dataset row → a PENDING prompt `Sample`; `where` is "file:line" for errors. A row with
    images is tokenized here, its image tokens expanded by `vision` (docs/vlm.md)."""
    prompt, images = _row_prompt(row, config, where, path)
    metadata = _row_metadata(row, config, where)
    label = row.get(config.label_key) if config.label_key is not None else None
    if images:
        ids, recipes = _expand(prompt, images, config, where, tokenizer, vision, max_prompt_tokens)
        return Sample(prompt=prompt, label=label, tokens=ids, images=recipes, metadata=metadata)
    if config.apply_chat_template and tokenizer is not None:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if max_prompt_tokens is not None and tokenizer is not None:
        _check_prompt_tokens(prompt, where, tokenizer, max_prompt_tokens)
    return Sample(prompt=prompt, label=label, metadata=metadata, status=Status.PENDING)


def _row_prompt(row: Any, config: DataConfig, where: str, path: Path | None) -> tuple[Any, Any]:
    """The row's prompt (a non-empty string or chat messages) and its images; `DataError` else."""
    if not isinstance(row, dict):
        raise DataError(
            f"{where}: the row is a JSON {type(row).__name__}, not an object; "
            f'fix: write each row as an object like {{"{config.input_key}": "...", "label": ...}}'
        )
    if config.input_key not in row:
        raise DataError(
            f"{where}: the row has no {config.input_key!r} key (it has {sorted(row)}); "
            f"fix: add it to the row, or set data.input_key to the key that holds the prompt"
        )
    prompt, images = _row_images(row[config.input_key], row, config, where, path)
    if isinstance(prompt, list):
        bad = _check_messages(prompt)
        if bad:
            raise DataError(
                f"{where}: {config.input_key!r} is a list but not chat messages: {bad}; "
                f'fix: use a string, or [{{"role": "user", "content": "..."}}]'
            )
    elif not isinstance(prompt, str):
        raise DataError(
            f"{where}: {config.input_key!r} is a {type(prompt).__name__}; "
            f"fix: make the prompt a string or a list of chat messages"
        )
    if not prompt or (isinstance(prompt, str) and not prompt.strip()):
        raise DataError(
            f"{where}: {config.input_key!r} is empty (the engine would get no input ids); "
            f"fix: write a prompt, or remove the row"
        )
    return prompt, images


def _row_metadata(row: dict[str, Any], config: DataConfig, where: str) -> dict[str, Any]:
    """A copy of the row's `data.metadata_key` object (empty without one)."""
    if config.metadata_key is None or row.get(config.metadata_key) is None:
        return {}
    metadata = row[config.metadata_key]
    if not isinstance(metadata, dict):
        raise DataError(
            f"{where}: {config.metadata_key!r} is a {type(metadata).__name__}, not an object; "
            f"fix: make it an object (it is copied into sample.metadata), or set data.metadata_key"
        )
    return dict(metadata)


def _check_prompt_tokens(prompt: Any, where: str, tokenizer: Any, max_prompt_tokens: int) -> None:
    """The prompt tokenizes to at least one token and leaves room for a response in the context."""
    from verst.rollout.generate import prompt_token_ids

    n = len(prompt_token_ids(tokenizer, prompt, False))
    if n == 0:
        raise DataError(
            f"{where}: the prompt tokenizes to no tokens (the engine would get no input ids); "
            f"fix: write a prompt the tokenizer encodes, or remove the row"
        )
    if n >= max_prompt_tokens:
        raise DataError(
            f"{where}: the prompt has {n} tokens and the context holds {max_prompt_tokens} "
            f"(rollout.max_context_len, or the model's max_position_embeddings): no room for a "
            f"response; fix: shorten or remove the row, or raise rollout.max_context_len"
        )


def _read_jsonl(
    path: Path, config: DataConfig, tokenizer: Any, limit: int | None, vision: Any = None
) -> list[Sample]:
    samples = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{where}: not valid UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1}); "
                    f"fix: re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); "
                    f"fix: write one complete JSON object per line"
                ) from None
            samples.append(_row_to_sample(row, config, where, tokenizer, limit, vision, path))
    return samples


def _read_parquet(
    path: Path, config: DataConfig, tokenizer: Any, limit: int | None, vision: Any = None
) -> list[Sample]:
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError as exc:
        if exc.name not in ("pyarrow", "pyarrow.parquet"):
            raise
        raise MissingOptionalDependency(
            f"reading {path} needs pyarrow, which is not installed; "
            f"install it with `uv sync --extra parquet` (or `pip install verst-rollout-core[parquet]`)"
        ) from exc
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc}); fix: rewrite it with pyarrow") from exc
    return [
        _row_to_sample(row, config, f"{path}:row {i}", tokenizer, limit, vision, path)
        for i, row in enumerate(rows, 1)
    ]


def load_prompt_samples(
    config: DataConfig, *, tokenizer: Any = None, max_prompt_tokens: int | None = None, vision: Any = None
) -> list[Sample]:
    """Every prompt of a dataset as PENDING samples, in file order (or shuffled with `seed`).

    `tokenizer` renders prompts when `apply_chat_template` is on. With `max_prompt_tokens` (and a
    tokenizer) a prompt of that many tokens or more — no room left for a response in the
    context — is a `DataError` naming its file and line, found before any rollout (the engine
    would refuse it with a 4xx at generation time).
    """
    if config.path is None:
        raise DataError("data.path is not set; fix: point it at a JSONL or Parquet file of prompts")
    path = Path(config.path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; fix: check data.path (relative paths are from the cwd)")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        samples = _read_jsonl(path, config, tokenizer, max_prompt_tokens, vision)
    elif suffix in PARQUET_SUFFIXES:
        samples = _read_parquet(path, config, tokenizer, max_prompt_tokens, vision)
    else:
        raise DataError(
            f"{path}: unknown file type {suffix!r}; fix: use one of {[*JSONL_SUFFIXES, *PARQUET_SUFFIXES]}"
        )
    if config.shuffle:
        random.Random(config.seed).shuffle(samples)
    return samples


def check_group_size(n_samples_per_prompt: int) -> None:
    """A `ValueError` unless a group has at least one sample."""
    if n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")


class PromptDataSource:
    """The training `DataSource` over one prompt file.

    Epoch `e` visits the prompts in the order of `random.Random(seed + e)` (file order when
    `shuffle` is off), so its position is two integers and resuming needs no RNG state.
    """

    def __init__(
        self,
        config: DataConfig,
        n_samples_per_prompt: int,
        *,
        tokenizer: Any = None,
        max_prompt_tokens: int | None = None,
        vision: Any = None,
    ) -> None:
        """`vision`: the model's `MultimodalProcessor`, for rows with images (docs/vlm.md)."""
        check_group_size(n_samples_per_prompt)
        file_config = config.model_copy(update={"shuffle": False})
        prompts = load_prompt_samples(
            file_config, tokenizer=tokenizer, max_prompt_tokens=max_prompt_tokens, vision=vision
        )
        if not prompts:
            raise DataError(f"{config.path}: the dataset has no rows; fix: add prompts to it")
        self._serve(config, prompts, n_samples_per_prompt)

    def _serve(self, config: DataConfig, prompts: list[Sample], n_samples_per_prompt: int) -> None:
        """Serve `prompts` in groups of `n_samples_per_prompt`, epochs ordered by `config`'s
        `shuffle` and `seed`, from the start."""
        self.config = config
        """The dataset section of the config (`shuffle`, `seed`)."""
        self.n_samples_per_prompt = n_samples_per_prompt
        """Samples per group."""
        self._prompts = prompts
        self.epoch = 0
        """Current epoch (0-based)."""
        self.offset = 0
        """Prompts of the current epoch already handed out."""
        self._buffer: deque[list[Sample]] = deque()
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        """Number of prompts in the dataset."""
        return len(self._prompts)

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            order = list(range(len(self._prompts)))
            if self.config.shuffle:
                random.Random(self.config.seed + self.epoch).shuffle(order)
            self._order, self._order_epoch = order, self.epoch
        return self._order

    def _next_prompt(self) -> Sample:
        if self.offset >= len(self._prompts):
            self.epoch += 1
            self.offset = 0
        prompt = self._prompts[self._epoch_order()[self.offset]]
        self.offset += 1
        return prompt

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """`num_groups` groups: returned groups first (oldest first), then fresh prompts."""
        groups: list[list[Sample]] = []
        while self._buffer and len(groups) < num_groups:
            groups.append(self._buffer.popleft())
        while len(groups) < num_groups:
            prompt = self._next_prompt()
            groups.append([prompt.clone() for _ in range(self.n_samples_per_prompt)])
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Take back unused groups (kept as they are, partial tokens included); served first."""
        self._buffer.extend(list(g) for g in groups)

    @property
    def num_buffered_groups(self) -> int:
        """Groups waiting in the return buffer."""
        return len(self._buffer)

    def state_dict(self) -> dict[str, Any]:
        """JSON-friendly state: epoch, offset, and the returned groups."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "num_prompts": len(self._prompts),
            "seed": self.config.seed,
            "shuffle": self.config.shuffle,
            "buffer": [[s.to_dict() for s in g] for g in self._buffer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`; refuses a state saved over a different dataset or seed."""
        mismatched = [
            f"{key} (saved {state.get(key)!r}, now {now!r})"
            for key, now in (
                ("num_prompts", len(self._prompts)),
                ("seed", self.config.seed),
                ("shuffle", self.config.shuffle),
            )
            if key in state and state[key] != now
        ]
        if mismatched:
            raise DataError(
                f"{self.config.path}: the saved data-source state does not match this dataset: "
                f"{', '.join(mismatched)}; fix: resume with the dataset and data.seed/shuffle of the saved run"
            )
        if not 0 <= state["offset"] <= len(self._prompts):
            raise DataError(
                f"saved offset {state['offset']} is outside the dataset of {len(self._prompts)} rows"
            )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._buffer = deque([Sample.from_dict(d) for d in g] for g in state.get("buffer", []))
