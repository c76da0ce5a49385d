"""Dataset rows with images: paths, base64, chat image parts; every bad input a clear error."""

import base64
import json

import pytest

from verst.rollout.config import DataConfig
from verst.rollout.data import PromptDataSource, load_prompt_samples
from verst.rollout.errors import DataError
from verst.rollout.multimodal.processor import MultimodalProcessor


@pytest.fixture(scope="module")
def llava(vlm_checkpoints):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vlm_checkpoints["llava"])
    return tok, MultimodalProcessor.from_pretrained(vlm_checkpoints["llava"], tok)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_with_paths_base64_and_chat_parts(tmp_path, llava, image_files):
    tok, vision = llava
    b64 = base64.b64encode(image_files[1].read_bytes()).decode()
    data = _write(
        tmp_path / "d.jsonl",
        [
            {"prompt": "colour of <image>?", "images": [str(image_files[0])], "label": "red"},
            {"prompt": "no placeholder", "images": [b64]},
            {
                "prompt": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "a "},
                            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                            {"type": "text", "text": " b"},
                        ],
                    }
                ]
            },
            {"prompt": "text only"},
        ],
    )
    samples = load_prompt_samples(DataConfig(path=str(data), shuffle=False), tokenizer=tok, vision=vision)
    n = 16  # (28 / 7) ** 2 image tokens per image for the tiny llava
    first = samples[0]
    assert first.tokens.count(vision.image_token_id) == n and len(first.images) == 1
    assert first.images[0]["sha256"] and first.images[0]["shapes"] == {"pixel_values": [3, 28, 28]}
    assert "pixels" not in first.images[0]  # the bounded recipe only
    # base64 went to the store once: rows 2 and 3 hold the same image file
    assert samples[1].images[0]["path"] == samples[2].images[0]["path"]
    assert samples[1].images[0]["offset"] == 0  # placeholder prepended
    assert samples[2].prompt[0]["content"] == "a <image> b"
    assert samples[3].images is None and samples[3].tokens == []
    # the group clones keep the recipe; the data source serves them
    groups = PromptDataSource(
        DataConfig(path=str(data), shuffle=False), 2, tokenizer=tok, vision=vision
    ).get_samples(1)
    assert groups[0][0].images == groups[0][1].images == first.images


def _bomb_png(width: int = 20_000, height: int = 10_000) -> bytes:
    """A valid 1-bit PNG of width × height (200 megapixels by default) that is a few KB on disk."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    packer = zlib.compressobj(9)
    row = bytes(1 + (width + 7) // 8)  # filter byte 0 + the row's bits, all black
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    ("row", "match"),
    [
        (
            {"prompt": "<image>", "images": ["missing.png"]},
            r"d\.jsonl:2: images\[0\]: image file .*missing\.png.* does not exist",
        ),
        ({"prompt": "<image>", "images": ["corrupt.png"]}, r"d\.jsonl:2: images\[0\].*not a readable image"),
        (
            {"prompt": "<image>", "images": ["data:image/png;base64,@@@"]},
            r"d\.jsonl:2: images\[0\]: not valid base64",
        ),
        (
            {"prompt": "<image><image>", "images": ["ok.png"]},
            r"d\.jsonl:2: .*2 <image> placeholder\(s\) but 1 image",
        ),
        (
            {"prompt": "<image>" * 5, "images": ["ok.png"] * 5},
            r"d\.jsonl:2: with its 5 image\(s\) expanded the prompt has 80 tokens and the context holds 64",
        ),
        ({"prompt": [{"role": "user", "content": [{"type": "video"}]}]}, r"d\.jsonl:2: message 0 part 0"),
        ({"prompt": "<image>", "images": ["bomb.png"]}, r"d\.jsonl:2: images\[0\].*decompression bomb"),
    ],
)
def test_bad_image_rows_name_file_and_line(tmp_path, llava, image_files, row, match):
    tok, vision = llava
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG not really")
    (tmp_path / "bomb.png").write_bytes(_bomb_png())
    (tmp_path / "ok.png").write_bytes(image_files[0].read_bytes())
    data = _write(tmp_path / "d.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(DataError, match=match):
        load_prompt_samples(DataConfig(path=str(data)), tokenizer=tok, vision=vision, max_prompt_tokens=64)
    assert (tmp_path / "ok.png").read_bytes() == image_files[0].read_bytes()  # nothing lost


def test_images_for_a_text_only_model_name_file_and_line(tmp_path, tiny_checkpoint, image_files):
    from transformers import AutoTokenizer

    from verst.rollout.multimodal.processor import TextOnlyModelError

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    data = _write(tmp_path / "d.jsonl", [{"prompt": "x <image>", "images": [str(image_files[0])]}])
    with pytest.raises(DataError, match=r"d\.jsonl:1: the row has 1 image\(s\) but the model is text-only"):
        load_prompt_samples(DataConfig(path=str(data)), tokenizer=tok, vision=None)
    with pytest.raises(TextOnlyModelError, match="text-only and takes no images"):
        MultimodalProcessor.from_pretrained(tiny_checkpoint, tok)
