"""Custom functions written for the v1 ABI, the way a slime / miles user writes them.

They take `args` (read settings by their v1 names), talk to the SGLang server at
`args.sglang_router_ip:args.sglang_router_port` over HTTP, and tokenize with the tokenizer at
`args.hf_checkpoint`. The tests run them UNCHANGED on verst's default path through
`LegacyRolloutFnAdapter`, `LegacyGenerateFnAdapter` and `LegacyRewardFnAdapter`.
"""

import asyncio

import aiohttp
from transformers import AutoTokenizer

from verst.rollout.sample import Status

_TOKENIZERS = {}


def get_tokenizer(args):
    if args.hf_checkpoint not in _TOKENIZERS:
        _TOKENIZERS[args.hf_checkpoint] = AutoTokenizer.from_pretrained(args.hf_checkpoint)
    return _TOKENIZERS[args.hf_checkpoint]


async def generate(args, sample, sampling_params):
    """A custom generate function: one /generate call, tokens and log-probs from the response."""
    tokenizer = get_tokenizer(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    if not sample.tokens:
        sample.tokens = tokenizer.encode(sample.prompt, add_special_tokens=False)
    payload = {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True}
    async with aiohttp.ClientSession() as session, session.post(url, json=payload) as resp:
        resp.raise_for_status()
        output = await resp.json()
    meta = output["meta_info"]
    new_tokens = [item[1] for item in meta["output_token_logprobs"]]
    new_logprobs = [item[0] for item in meta["output_token_logprobs"]]
    sample.tokens = sample.tokens + new_tokens
    sample.response_length += len(new_tokens)
    sample.response += output["text"]
    sample.rollout_logprobs = (sample.rollout_logprobs or []) + new_logprobs
    finish = meta["finish_reason"]["type"]
    if finish == "length":
        sample.status = Status.TRUNCATED
    elif finish == "abort":
        sample.status = Status.ABORTED
    else:
        sample.status = Status.COMPLETED
    return sample


async def reward(args, sample):
    """A custom reward: 1 if the label appears in the response, else 0."""
    return 1.0 if str(sample.label) in sample.response else 0.0


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """A custom (sync) rollout function: takes its own batch and drives the server itself."""
    if evaluation:
        raise NotImplementedError("this example has no eval")
    groups = data_source.get_samples(args.rollout_batch_size)
    sampling_params = {
        "temperature": args.rollout_temperature,
        "top_p": args.rollout_top_p,
        "top_k": args.rollout_top_k,
        "max_new_tokens": args.rollout_max_response_len,
        "stop": args.rollout_stop,
        "stop_token_ids": args.rollout_stop_token_ids,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }

    async def generate_and_score(sample):
        sample = await generate(args, sample, dict(sampling_params))
        sample.reward = await reward(args, sample)
        return sample

    async def run_all():
        return await asyncio.gather(*(generate_and_score(s) for group in groups for s in group))

    asyncio.run(run_all())
    return groups
