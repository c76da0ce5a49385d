"""Multi-turn with an image observation: an environment renders an image after the model's
first turn; the next request carries it, its tokens are masked out of the loss, and the
trainer's log-probs of the model's tokens equal the engine's (every layout)."""

import asyncio

import pytest
import torch

from verst.rollout.agentic import ModelTurn, Observation, StepResult
from verst.rollout.agentic.episode import AgenticGenerate
from verst.rollout.config import RolloutConfig
from verst.rollout.engine import SamplingParams
from verst.rollout.engines.embedded import EmbeddedEngine
from verst.rollout.multimodal.images import ImageStore
from verst.rollout.multimodal.processor import MultimodalProcessor, PromptImage
from verst.rollout.protocols import GenerateInput, GenerateState, RolloutContext
from verst.rollout.sample import Sample
from verst.trainer.train.layout import LAYOUTS
from verst.trainer.train.logprobs import PolicyLogprobs
from verst.trainer.train.vision import lay_out_with_images


class RenderEnv:
    """After each model turn, shows a rendered square whose colour depends on the turn."""

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self, sample):
        return None

    async def step(self, turn: ModelTurn) -> StepResult:
        from PIL import Image

        self.turns += 1
        if self.turns >= 3:
            return StepResult(done=True, reward=1.0)
        colour = (255, 0, 0) if self.turns == 1 else (0, 0, 255)
        return StepResult(
            observation=Observation(text=" see <image>:", images=(Image.new("RGB", (12, 9), colour),))
        )

    async def close(self):
        pass


@pytest.mark.parametrize("family", ["llava", pytest.param("idefics3", marks=pytest.mark.slow)])
async def test_image_observation_through_engine_and_trainer(family, vlm_checkpoints, image_files, tmp_path):
    path = vlm_checkpoints[family]
    store = ImageStore(tmp_path / "rendered")
    engine = EmbeddedEngine.from_pretrained(path)
    vision = MultimodalProcessor.from_pretrained(path, engine.tokenizer, store=store)
    config = RolloutConfig(
        batch_size=1, n_samples_per_prompt=1, max_response_len=60, env={"type": "tools", "max_turns": 3}
    )
    ctx = RolloutContext(
        config=config, data_source=None, engine=engine, tokenizer=engine.tokenizer, vision=vision
    )
    state = GenerateState(context=ctx, rollout_id=0, weight_version=0, semaphore=asyncio.Semaphore(4))
    prompt = vision.expand(
        engine.tokenizer("what is <image>?")["input_ids"], [vision.resolve(str(image_files[0]), what="t")]
    )
    sample = Sample(
        prompt="", tokens=prompt.input_ids, images=[im.to_dict() for im in prompt.images], sample_index=0
    )
    gen = AgenticGenerate(config.env, RenderEnv)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True, sampling_seed=3)
    try:
        out = await gen(GenerateInput(state, sample, params))
    finally:
        await engine.close()
    assert len(out.images) == 3  # the prompt's image and two rendered ones
    assert out.images[1]["path"].startswith(str(tmp_path / "rendered"))
    # the rendered images' tokens are in the response and masked out of the loss
    start = out.prompt_length
    mask = out.effective_loss_mask()
    for im in out.images[1:]:
        assert im["offset"] >= start
        assert all(mask[p - start] == 0 for p in range(im["offset"], im["offset"] + im["length"]))
    assert sum(mask) == 15  # three model turns of 5 tokens
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path)
    trainer_vision = MultimodalProcessor.from_pretrained(path, engine.tokenizer)
    images = [[PromptImage.from_dict(d) for d in out.images]]
    keep = torch.tensor(mask, dtype=torch.bool)
    engine_lp = torch.tensor([lp for lp, m in zip(out.rollout_logprobs, mask, strict=True) if m])
    with torch.no_grad():
        for name, layout in LAYOUTS.items():
            inputs = lay_out_with_images(layout, trainer_vision, [out.tokens], [out.response_length], images)
            lp, _ = PolicyLogprobs(model)(inputs, temperature=1.0)
            assert (lp[keep] - engine_lp).abs().max().item() < 1e-4, name
