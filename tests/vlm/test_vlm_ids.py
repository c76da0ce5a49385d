"""The image token ids and pixel inputs are identical on the engine's and the trainer's side.

The engine side is the embedded engine's prefill input (`_vision.prefill_kwargs` over a
request's expanded ids and recipes, with the pixels the rollout's processor made); the trainer
side is `lay_out_with_images` over the sample's tokens and the recipes after a JSON round trip
(no pixels: a fresh processor re-reads the files). Hypothesis draws image sizes, counts and
positions in the prompt."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verst.rollout.engine import GenerateRequest
from verst.rollout.engines.embedded.batch import Row
from verst.rollout.engines.embedded.sampling import RowSampling
from verst.rollout.engines.embedded.vision import prefill_kwargs
from verst.rollout.multimodal.images import ImageError, ImageStore
from verst.rollout.multimodal.processor import MultimodalProcessor, PromptImage
from verst.trainer.train.layout import LAYOUTS
from verst.trainer.train.vision import lay_out_with_images

FAMILIES = ("llava", "idefics3")


@pytest.fixture(scope="module")
def sides(vlm_checkpoints, tmp_path_factory):
    """family → (tokenizer, model, rollout processor, trainer processor, image store)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    out = {}
    for family, path in vlm_checkpoints.items():
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path).eval()
        store = ImageStore(tmp_path_factory.mktemp(f"store-{family}"))
        out[family] = (
            tok,
            model,
            MultimodalProcessor.from_pretrained(path, tok, store=store),
            MultimodalProcessor.from_pretrained(path, tok),
            store,
        )
    return out


images_st = st.lists(
    st.tuples(st.integers(1, 70), st.integers(1, 70), st.integers(0, 2**31 - 1)), min_size=0, max_size=4
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    family=st.sampled_from(FAMILIES), images=images_st, text=st.text("abc xyz?", max_size=12), data=st.data()
)
def test_image_ids_and_pixels_are_identical_on_both_sides(sides, family, images, text, data):
    from PIL import Image

    tok, model, rollout_proc, trainer_proc, _ = sides[family]
    pieces = list(text)
    for _ in images:  # each placeholder at a drawn position in the prompt
        pieces.insert(data.draw(st.integers(0, len(pieces))), "<image>")
    ids = tok("".join(pieces) or "a")["input_ids"] if pieces else tok("a")["input_ids"]
    pil = [
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))
        for h, w, seed in images
    ]
    resolved = [rollout_proc.resolve(im, what="test") for im in pil]
    expanded = rollout_proc.expand(ids, resolved)
    # every image became its family's expansion, at its placeholder, nothing else moved
    assert expanded.input_ids.count(rollout_proc.image_token_id) == sum(
        len(rollout_proc.feature_positions(expanded.input_ids, [im])) for im in expanded.images
    )
    assert [t for t in expanded.input_ids if t not in _image_ids(rollout_proc)] == [
        t for t in ids if t != rollout_proc.placeholder_id
    ]
    response = tok("ok")["input_ids"]
    tokens = expanded.input_ids + response
    # engine side
    request = GenerateRequest(expanded.input_ids, images=tuple(expanded.images))
    row = Row(request, RowSampling(1.0, 1.0, -1, None), frozenset(), 512)
    engine_ids = torch.tensor([expanded.input_ids])
    with torch.no_grad():
        engine_in = prefill_kwargs(rollout_proc, model, engine_ids, [row])
        engine_embeds = engine_in.get("inputs_embeds", model.get_input_embeddings()(engine_ids))[0]
    # trainer side: recipes through JSON (no pixels), a fresh processor
    recipes = [PromptImage.from_dict(im.to_dict()) for im in expanded.images]
    inputs = lay_out_with_images(LAYOUTS["padded"], trainer_proc, [tokens], [len(response)], [recipes])
    assert inputs.input_ids[0, : len(expanded.input_ids)].tolist() == expanded.input_ids
    for im, rec in zip(expanded.images, recipes, strict=True):
        for key, value in im.pixels.items():
            assert torch.equal(trainer_proc.rebuild(rec)[key], value)
    with torch.no_grad():
        trainer_embeds = inputs.vision.embeds(model, inputs.input_ids)[0, : len(expanded.input_ids)]
    torch.testing.assert_close(trainer_embeds, engine_embeds, rtol=0, atol=1e-6)


def _image_ids(proc):
    expansion = set(proc.family.expansion({"pixel_values": torch.zeros(3, 28, 28)}))
    return expansion | {proc.image_token_id}


@pytest.mark.parametrize("family", FAMILIES)
def test_double_expansion_and_miscounted_placeholders_are_refused(sides, family, image_files):
    tok, _, proc, _, _ = sides[family]
    refs = [proc.resolve(str(image_files[0]), what="t")]
    ex = proc.expand(tok("a<image>b")["input_ids"], refs)
    with pytest.raises(ImageError, match="already expanded"):
        proc.expand(ex.input_ids, refs)
    with pytest.raises(ImageError, match="has 2 <image> placeholder"):
        proc.expand(tok("<image><image>")["input_ids"], refs)


@pytest.mark.parametrize("family", FAMILIES)
def test_changed_image_file_is_refused_when_rebuilt(sides, family, tmp_path):
    from PIL import Image

    tok, _, proc, trainer, _ = sides[family]
    path = tmp_path / "x.png"
    Image.new("RGB", (9, 9), (255, 0, 0)).save(path)
    ex = proc.expand(tok("<image>")["input_ids"], [proc.resolve(str(path), what="t")])
    Image.new("RGB", (9, 9), (0, 0, 255)).save(path)
    fresh = MultimodalProcessor(trainer.family, trainer.placeholder_id)
    with pytest.raises(ImageError, match="changed since it was read"):
        fresh.rebuild(PromptImage.from_dict(ex.images[0].to_dict()))
