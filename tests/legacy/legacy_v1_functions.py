"""Custom functions written for the v1 ABI (slime/miles), used unchanged on the legacy path."""

from __future__ import annotations

from typing import Any

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.sample import Sample, Status

CALLS: list[dict[str, Any]] = []
"""What `v1_generate` saw (args names, sampling params), for the tests to inspect."""


async def v1_generate(
    args, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> Sample:
    """A v1 generate function: reads slime's args names and a SGLang sampling dict.

    It reaches the engine through `args.runtime`, the legacy strategy's explicit runtime (what
    slime kept in its module-global GenerateState).
    """
    CALLS.append(
        {
            "max_new_tokens": sampling_params["max_new_tokens"],
            "temperature": sampling_params["temperature"],
            "rollout_max_response_len": args.rollout_max_response_len,
            "evaluation": evaluation,
        }
    )
    runtime = args.runtime
    prompt_ids = runtime.tokenizer.encode(sample.prompt)
    out = await runtime.engine.generate(
        GenerateRequest(
            input_ids=prompt_ids,
            sampling=SamplingParams(max_new_tokens=sampling_params["max_new_tokens"]),
            rid=f"custom-{sample.sample_index}",
        )
    )
    sample.tokens = prompt_ids + out.output_ids
    sample.response_length = len(out.output_ids)
    sample.response = runtime.tokenizer.decode(out.output_ids) + "!"
    sample.rollout_logprobs = list(out.output_logprobs)
    sample.weight_versions = [out.weight_version]
    sample.status = Status.TRUNCATED
    sample.metadata["generated_by"] = "v1_generate"
    return sample


async def group_reward(args, samples: list[Sample]) -> list[float]:
    """A v1 group reward: rank of each sample by response text within the group."""
    order = sorted(range(len(samples)), key=lambda i: (samples[i].response, i))
    ranks = [0.0] * len(samples)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks


def keep_even_groups(group: list[Sample]) -> bool:
    """A v1 dynamic filter (returns a bare bool): keep groups with an even group index."""
    return (group[0].group_index or 0) % 2 == 0


async def v1_multi_turn_generate(args, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """A slime-style v1 multi-turn generate function: two model turns with an injected
    observation between them, one sample with its own loss mask (0 on the observation)."""
    runtime = args.runtime
    tok = runtime.tokenizer
    prompt_ids = tok.encode(sample.prompt)
    tokens, mask, logprobs, response = list(prompt_ids), [], [], ""
    for turn in range(2):
        out = await runtime.engine.generate(
            GenerateRequest(
                input_ids=tokens,
                sampling=SamplingParams(max_new_tokens=sampling_params["max_new_tokens"]),
                rid=f"mt-{sample.sample_index}-{turn}",
            )
        )
        tokens += out.output_ids
        mask += [1] * len(out.output_ids)
        logprobs += list(out.output_logprobs)
        response += tok.decode(out.output_ids)
        if turn == 0:
            obs = tok.encode("|obs|")
            tokens += obs
            mask += [0] * len(obs)
            logprobs += [0.0] * len(obs)
            response += "|obs|"
    sample.tokens = tokens
    sample.response_length = len(tokens) - len(prompt_ids)
    sample.response = response
    sample.loss_mask = mask
    sample.rollout_logprobs = logprobs
    sample.weight_versions = [out.weight_version]
    sample.status = Status.COMPLETED
    return sample
