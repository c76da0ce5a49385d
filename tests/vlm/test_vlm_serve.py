"""Images over HTTP: `verst serve`'s native /generate with sglang's `image_data` (placeholder
ids + data URLs, expanded again by the server's processor), the SGLang client sending images
that way, and OpenAI chat with `image_url` parts. A real server on loopback."""

import base64

import aiohttp
from serve_testlib import serve

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded import EmbeddedEngine
from verst.rollout.engines.sglang_client import SGLangClient
from verst.rollout.multimodal.wire import collapse_ids


async def test_sglang_wire_images_round_trip_through_verst_serve(vlm_checkpoints, image_files):
    path = vlm_checkpoints["llava"]
    local = EmbeddedEngine.from_pretrained(path)
    try:
        ids = local.tokenizer("<image> vs <image>:")["input_ids"]
        expanded = local.vision.expand(ids, [local.vision.resolve(str(p), what="t") for p in image_files[:2]])
        assert collapse_ids(expanded.input_ids, expanded.images) == ids  # the wire form
        sampling = SamplingParams(temperature=1.0, max_new_tokens=6, sampling_seed=7, ignore_eos=True)
        request = GenerateRequest(expanded.input_ids, sampling, images=tuple(expanded.images))
        want = await local.generate(request)
    finally:
        await local.close()
    async with serve(path) as url:
        client = SGLangClient(url)
        try:
            got = await client.generate(request)
        finally:
            await client.close()
        assert got.prompt_tokens == len(expanded.input_ids)  # the server expanded to the same ids
        assert got.output_ids == want.output_ids
        assert max(abs(a - b) for a, b in zip(got.output_logprobs, want.output_logprobs, strict=True)) < 1e-5
        b64 = base64.b64encode(image_files[0].read_bytes()).decode()
        body = {
            "model": "m",
            "max_tokens": 3,
            "return_prompt_token_ids": True,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is "},
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                    ],
                }
            ],
        }
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                data = await r.json()
            prompt_ids = data["choices"][0]["prompt_token_ids"]
            assert prompt_ids.count(expanded.images[0].placeholder) == 16  # one image, expanded
            bad = {"input_ids": ids, "image_data": ["data:image/png;base64,AAAA"]}
            async with s.post(f"{url}/generate", json=bad) as r:
                assert r.status == 400 and "not a readable image" in await r.text()


async def test_image_data_to_a_text_only_server_is_refused(tiny_checkpoint, image_files):
    async with serve(tiny_checkpoint) as url:
        b64 = base64.b64encode(image_files[0].read_bytes()).decode()
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/generate", json={"input_ids": [5, 6], "image_data": b64}) as r:
                assert r.status == 400 and "text-only model" in await r.text()
            chat = {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": b64}}]}],
            }
            async with s.post(f"{url}/v1/chat/completions", json=chat) as r:
                assert r.status == 400 and "text-only model" in await r.text()
