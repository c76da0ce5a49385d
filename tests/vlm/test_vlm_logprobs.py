"""Engine vs trainer on image prompts: the embedded engine's sampled log-probs equal the
trainer's (`PolicyLogprobs` with `lay_out_with_images`) in every layout, for both families."""

import pytest
import torch

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded import EmbeddedEngine
from verst.rollout.multimodal.images import resolve_image
from verst.rollout.multimodal.processor import MultimodalProcessor
from verst.trainer.train.layout import LAYOUTS
from verst.trainer.train.logprobs import PolicyLogprobs
from verst.trainer.train.vision import lay_out_with_images

FAMILIES = ("llava", "idefics3")


def _prompt(engine, image_paths, text):
    ids = engine.tokenizer(text)["input_ids"]
    images = [resolve_image(str(p), what="test", store=None) for p in image_paths]
    return engine.vision.expand(ids, images)


@pytest.mark.parametrize("family", ["llava", pytest.param("idefics3", marks=pytest.mark.slow)])
async def test_engine_and_trainer_logprobs_match_on_image_prompts(family, vlm_checkpoints, image_files):
    path = vlm_checkpoints[family]
    engine = EmbeddedEngine.from_pretrained(path, batch_wait_s=0.01)
    try:
        prompts = [
            _prompt(engine, image_files[:1], "what is <image>?"),
            _prompt(engine, image_files[1:3], "<image> and <image> differ:"),
            _prompt(engine, image_files[3:4], "same text <image>?"),  # same ids as the next, other image
            _prompt(engine, image_files[4:5], "same text <image>?"),
        ]
        requests = []
        for p in prompts:
            for k in range(2):  # a group of two: prefix sharing within, never across images
                sampling = SamplingParams(temperature=1.0, max_new_tokens=6, sampling_seed=k, ignore_eos=True)
                requests.append(GenerateRequest(p.input_ids, sampling, images=tuple(p.images)))
        import asyncio

        outs = await asyncio.gather(*(engine.generate(r) for r in requests))
        assert engine.prefill_tokens_saved == sum(len(p.input_ids) for p in prompts)  # one copy per group
    finally:
        await engine.close()

    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    trainer_processor = MultimodalProcessor.from_pretrained(path, engine.tokenizer)  # its own, fresh
    tokens = [r.input_ids + o.output_ids for r, o in zip(requests, outs, strict=True)]
    resp = [len(o.output_ids) for o in outs]
    images = [[im.__class__.from_dict(im.to_dict()) for im in r.images] for r in requests]  # no pixels
    engine_lp = torch.tensor([lp for o in outs for lp in o.output_logprobs])
    wrapper = PolicyLogprobs(model)
    with torch.no_grad():
        for name, layout in LAYOUTS.items():
            inputs = lay_out_with_images(layout, trainer_processor, tokens, resp, images)
            lp, _ = wrapper(inputs, temperature=1.0)
            assert (lp - engine_lp).abs().max().item() < 1e-4, name
    # the shared layout kept the two prompts with equal ids but different images apart
    shared = lay_out_with_images(LAYOUTS["shared_prompt"], trainer_processor, tokens, resp, images)
    assert shared.input_ids.shape[0] == len(prompts)


@pytest.mark.parametrize("family", FAMILIES)
async def test_image_to_text_only_model_is_refused(family, vlm_checkpoints, tiny_checkpoint, image_files):
    vlm = EmbeddedEngine.from_pretrained(vlm_checkpoints[family])
    text_only = EmbeddedEngine.from_pretrained(tiny_checkpoint)
    try:
        p = _prompt(vlm, image_files[:1], "x <image>")
        from verst.rollout.engines.common.errors import InvalidRequest

        with pytest.raises(InvalidRequest, match="text-only model"):
            await text_only.generate(GenerateRequest(p.input_ids[:3], images=tuple(p.images)))
        # ids whose image span does not hold image tokens: a clear error, not a wrong forward
        with pytest.raises(InvalidRequest, match="no image tokens"):
            await vlm.generate(GenerateRequest([5] * len(p.input_ids), images=tuple(p.images)))
        out = await vlm.generate(
            GenerateRequest(p.input_ids, SamplingParams(max_new_tokens=2), images=tuple(p.images))
        )
        assert len(out.output_ids) == 2  # the engine still serves after refusing
    finally:
        await vlm.close()
        await text_only.close()
