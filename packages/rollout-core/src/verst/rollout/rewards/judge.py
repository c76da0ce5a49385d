"""LLM-as-judge: a judge model scores each answer (`rollout.reward.type = "judge"`).

The judge prompt is `rollout.reward.judge.template` filled with the sample's `{prompt}`,
`{response}`, `{label}` and the config's `{rubric}`; the verdict becomes a score by the parser the
config names (`judge_parsers`). The judge runs on its own engine — any `[engine]` type, built
from `rollout.reward.judge.engine` (an embedded small judge, `verst serve`, SGLang, vLLM) — or
on any OpenAI-compatible server at `rollout.reward.judge.url`. It is never refit with the policy
(nothing hands it to the weight sync), even when it loads the policy's own checkpoint.

Calls are bounded by the judge's own `max_concurrency` and `timeout_s`; rewards run after a
sample's generation and outside the rollout's engine semaphore, so judge calls overlap the
generation of other samples (`benchmarks/judge_overlap.py`). Verdicts are cached within a run by
(judge, template, rubric, parser, prompt, response, label): a repeated answer is judged once.
A judge that times out, dies or answers something unparsable raises `JudgeError`: the
strategy marks that sample FAILED and counts it in `rollout/reward_errors`; the run goes on.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, Protocol

from verst.rollout.engine import GenerateRequest, InferenceEngine, SamplingParams
from verst.rollout.rewards.judge_parsers import JudgeError, JudgeVerdictError, Verdict, build_parser
from verst.rollout.sample import Sample

if TYPE_CHECKING:
    from verst.rollout.config import JudgeConfig


class JudgeBackend(Protocol):
    """Where verdicts come from: an engine or an OpenAI-compatible server."""

    name: str
    """Identity of the judge (part of the cache key and of error messages)."""

    async def verdict(self, prompt: str, *, max_new_tokens: int, yes_no: tuple[str, str] | None) -> Verdict:
        """The judge's greedy answer to `prompt`; with `yes_no`, the log-probs of those two
        tokens at the first answer position instead (as `{"yes": lp, "no": lp}`)."""
        ...

    async def aclose(self) -> None:
        """Release the judge (engine threads, HTTP sessions)."""
        ...


class EngineJudge:
    """A judge on an `InferenceEngine` (greedy decoding); the engine is built on first use when
    given as a config (`rollout.reward.judge.engine`)."""

    def __init__(self, engine: InferenceEngine | Any, tokenizer: Any = None, *, name: str = "engine") -> None:
        """`engine`: an engine, or an engine config (`EngineSection`) built on first use;
        `tokenizer`: None = the engine's own (`engine.tokenizer`)."""
        self.name = name
        self._engine = engine if isinstance(engine, InferenceEngine) else None
        self._config = None if self._engine is not None else engine
        self._tokenizer = tokenizer
        self._lock: asyncio.Lock | None = None

    async def engine(self) -> InferenceEngine:
        """The judge's engine (built once, on first use, from its config)."""
        if self._engine is None:
            self._lock = self._lock or asyncio.Lock()
            async with self._lock:
                if self._engine is None:
                    from verst.rollout.engines.config import build_engine

                    self._engine = await build_engine(self._config, max_concurrency=64)
        return self._engine

    def tokenizer(self, engine: InferenceEngine) -> Any:
        """The tokenizer prompts are encoded with."""
        if self._tokenizer is None:
            self._tokenizer = getattr(engine, "tokenizer", None)
        if self._tokenizer is None:
            raise JudgeError(f"judge {self.name}: no tokenizer; set rollout.reward.judge.tokenizer_path")
        return self._tokenizer

    def _token_id(self, tokenizer: Any, text: str) -> int:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise JudgeError(
                f"judge {self.name}: {text!r} is {len(ids)} tokens for the judge's tokenizer; "
                f"yes_no_logprob needs one token each (set rollout.reward.judge.yes / .no)"
            )
        return int(ids[0])

    async def verdict(self, prompt: str, *, max_new_tokens: int, yes_no: tuple[str, str] | None) -> Verdict:
        engine = await self.engine()
        tok = self.tokenizer(engine)
        ids = list(tok.encode(prompt, add_special_tokens=True))
        if yes_no is None:
            req = GenerateRequest(ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
            out = await engine.generate(req)
            return Verdict(out.text or tok.decode(out.output_ids, skip_special_tokens=True))
        pair = [self._token_id(tok, yes_no[0]), self._token_id(tok, yes_no[1])]
        req = GenerateRequest(ids, SamplingParams(max_new_tokens=1, temperature=0.0), token_ids_logprob=pair)
        out = await engine.generate(req)
        rows = out.output_token_ids_logprobs or [[]]
        by_id = {int(tid): float(lp) for lp, tid in rows[0]}
        logprobs = {k: by_id[t] for k, t in zip(("yes", "no"), pair, strict=True) if t in by_id}
        return Verdict(out.text, logprobs)

    async def aclose(self) -> None:
        if self._engine is not None:
            await self._engine.close()


class OpenAIJudge:
    """A judge behind an OpenAI-compatible `/v1/completions` (vLLM, SGLang, `verst serve`, ...)."""

    def __init__(self, url: str, model: str, *, max_connections: int = 64) -> None:
        from verst.rollout.engines.common.http import HttpSettings, RetryingHttp

        self.url = url.rstrip("/")
        self.name = f"{self.url} ({model})"
        self.model = model
        # one attempt: the judge's timeout bounds the whole call, a failure is a reward error
        self._http = RetryingHttp(HttpSettings(max_connections=max_connections, max_retries=0))

    async def verdict(self, prompt: str, *, max_new_tokens: int, yes_no: tuple[str, str] | None) -> Verdict:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 1 if yes_no else max_new_tokens,
            "temperature": 0.0,
        }
        if yes_no:
            body["logprobs"] = 20
        data = await self._http.call("POST", f"{self.url}/completions", body)
        try:
            choice = data["choices"][0]
            text = str(choice.get("text") or "")
            tops = ((choice.get("logprobs") or {}).get("top_logprobs") or [{}])[0] if yes_no else {}
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise JudgeError(
                f"judge {self.name} answered {json.dumps(data)[:200] if not isinstance(data, str) else data[:200]!r}, "
                f"not an OpenAI completion"
            ) from exc
        logprobs = {}
        for key, token in zip(("yes", "no"), yes_no or (), strict=False):
            if token in tops:
                logprobs[key] = float(tops[token])
        return Verdict(text, logprobs)

    async def aclose(self) -> None:
        await self._http.close()


def _as_text(value: Any) -> str:
    """A prompt (text or chat messages) or label as judge-prompt text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return "\n".join(str(m.get("content", "")) for m in value)
    return "" if value is None else str(value)


class JudgeReward:
    """An async `RewardFn`: the judge's verdict on the sample, parsed into a score."""

    def __init__(self, backend: JudgeBackend, config: JudgeConfig) -> None:
        self.backend = backend
        """Where verdicts come from."""
        self.config = config
        """The judge section (template, parser, limits)."""
        self.parser = build_parser(config)
        self.render(Sample(prompt="", response="", label=""))  # a bad template fails here
        self.calls = 0
        """Judge calls made (cache hits excluded)."""
        self.cache_hits = 0
        """Samples scored from the cache."""
        self.errors = 0
        """Judge calls that failed (timeout, dead judge, unparsable verdict): reward errors."""
        self._scores: dict[tuple[str, ...], float] = {}
        self._pending: dict[tuple[str, ...], asyncio.Future[float]] = {}
        self._semaphore: tuple[Any, asyncio.Semaphore] | None = None

    @classmethod
    def from_config(cls, config: JudgeConfig) -> JudgeReward:
        """The judge `rollout.reward.judge` describes (its engine is built on first use)."""
        if (config.engine is None) == (config.url is None):
            raise JudgeError("rollout.reward.judge needs exactly one of engine and url")
        if config.url is not None:
            return cls(OpenAIJudge(config.url, config.model, max_connections=config.max_concurrency), config)
        from verst.rollout.engines.config import parse_engine_config

        engine_config = parse_engine_config(config.engine)
        tokenizer = None
        tok_path = (
            config.tokenizer_path
            or getattr(engine_config, "tokenizer_path", None)
            or engine_config.model_path
        )
        if engine_config.type != "embedded" and tok_path:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tok_path)
        name = f"{engine_config.type}:{engine_config.model_path}"
        return cls(EngineJudge(engine_config, tokenizer, name=name), config)

    counter_prefix = "reward/judge"
    """Where `counters()` go in the run metrics (`reward/judge/calls`, ...; `rewards.counters`)."""

    def counters(self) -> dict[str, int]:
        """Totals since the judge was built: judge calls, cache hits, failed calls."""
        return {"calls": self.calls, "cache_hits": self.cache_hits, "errors": self.errors}

    def render(self, sample: Sample) -> str:
        """The judge prompt for `sample`."""
        fields = {
            "prompt": _as_text(sample.prompt),
            "response": sample.response,
            "label": _as_text(sample.label),
            "rubric": self.config.rubric,
        }
        try:
            return self.config.template.format_map(fields)
        except (KeyError, IndexError, ValueError) as exc:
            raise JudgeError(
                f"rollout.reward.judge.template cannot be filled ({type(exc).__name__}: {exc}); "
                f"use only {{prompt}}, {{response}}, {{label}} and {{rubric}} (double other braces)"
            ) from exc

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._semaphore[0] is not loop:
            self._semaphore = (loop, asyncio.Semaphore(self.config.max_concurrency))
        return self._semaphore[1]

    async def __call__(self, sample: Sample) -> float:
        prompt = self.render(sample)
        if not self.config.cache:
            return await self._judge(prompt)
        c = self.config
        key = (self.backend.name, c.template, c.rubric, c.parser, prompt)
        if key in self._scores:
            self.cache_hits += 1
            return self._scores[key]
        pending = self._pending.get(key)
        if pending is not None and pending.get_loop() is asyncio.get_running_loop():
            self.cache_hits += 1
            return await asyncio.shield(pending)
        task = asyncio.ensure_future(self._judge(prompt))
        self._pending[key] = task
        try:
            score = await asyncio.shield(task)
        finally:
            if task.done():
                self._pending.pop(key, None)
        self._scores[key] = score
        return score

    async def _judge(self, prompt: str) -> float:
        c = self.config
        yes_no = (c.yes, c.no) if self.parser.needs_logprobs else None
        async with self._limit():
            self.calls += 1
            try:
                verdict = await asyncio.wait_for(
                    self.backend.verdict(prompt, max_new_tokens=c.max_new_tokens, yes_no=yes_no), c.timeout_s
                )
            except TimeoutError as exc:
                self.errors += 1
                raise JudgeError(
                    f"judge {self.backend.name} gave no verdict within {c.timeout_s:g} s; check the judge "
                    f"or raise rollout.reward.judge.timeout_s"
                ) from exc
            except JudgeError:
                self.errors += 1
                raise
            except Exception as exc:
                self.errors += 1
                raise JudgeError(f"judge {self.backend.name} failed: {type(exc).__name__}: {exc}") from exc
        try:
            return self.parser(verdict)
        except JudgeVerdictError as exc:
            self.errors += 1
            raise JudgeVerdictError(f"judge {self.backend.name}: {exc}") from exc

    async def aclose(self) -> None:
        """Close the judge's engine or HTTP session."""
        await self.backend.aclose()
