"""One bad image fails only its own request: an image file that vanished or changed after the
request was expanded makes that request fail with an error naming the file, while the requests
admitted in the same prefill wave complete (issue 39 item 2)."""

import asyncio
import shutil

from verst.rollout.engine import EngineError, GenerateRequest, SamplingParams
from verst.rollout.engines.embedded import EmbeddedEngine
from verst.rollout.multimodal.images import resolve_image
from verst.rollout.multimodal.processor import MultimodalProcessor, PromptImage


async def test_a_vanished_or_changed_image_fails_only_its_request(vlm_checkpoints, image_files, tmp_path):
    path = vlm_checkpoints["llava"]
    engine = EmbeddedEngine.from_pretrained(path, batch_wait_s=0.2)  # one admission wave for all eight
    try:
        expander = MultimodalProcessor.from_pretrained(path, engine.tokenizer)  # the rollout side's own
        files = [shutil.copy(image_files[i % len(image_files)], tmp_path / f"im{i}.png") for i in range(8)]
        requests = []
        for i, f in enumerate(files):
            ids = engine.tokenizer(f"<image> number {i}?")["input_ids"]
            ex = expander.expand(ids, [resolve_image(str(f), what="test", store=None)])
            images = tuple(PromptImage.from_dict(im.to_dict()) for im in ex.images)  # as a sample carries them
            sampling = SamplingParams(temperature=1.0, max_new_tokens=4, sampling_seed=i, ignore_eos=True)
            requests.append(GenerateRequest(ex.input_ids, sampling, images=images))
        (tmp_path / "im2.png").unlink()  # vanished after expansion
        shutil.copy(image_files[0], tmp_path / "im5.png")  # changed after expansion (another image)
        outs = await asyncio.gather(*(engine.generate(r) for r in requests), return_exceptions=True)
    finally:
        await engine.close()
    bad = {i: o for i, o in enumerate(outs) if isinstance(o, BaseException)}
    assert sorted(bad) == [2, 5], outs
    assert all(isinstance(e, EngineError) for e in bad.values())
    assert "im2.png" in str(bad[2]) and "im5.png" in str(bad[5])
    for i, o in enumerate(outs):
        if i not in bad:
            assert len(o.output_ids) == 4 and len(o.output_logprobs) == 4
