"""Tiny vision-language checkpoints (LLaVA and Idefics3, built from config) and image files."""

import numpy as np
import pytest

FAMILIES = ("llava", "idefics3")


@pytest.fixture(scope="session")
def vlm_checkpoints(tmp_path_factory):
    """family → a tiny VLM checkpoint directory (random init, saved in the HF layout)."""
    from verst.rollout.multimodal.toy import make_tiny_vlm_checkpoint

    root = tmp_path_factory.mktemp("vlm")
    return {f: make_tiny_vlm_checkpoint(root / f, family=f, seed=1) for f in FAMILIES}


@pytest.fixture(scope="session")
def image_files(tmp_path_factory):
    """Six PNG files of different sizes and contents."""
    from PIL import Image

    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate([(28, 28), (40, 56), (17, 9), (64, 32), (5, 5), (30, 31)]):
        path = root / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths
