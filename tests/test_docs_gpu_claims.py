"""Claims in the docs about the GPU path that the code or SGLang 0.5.23's source decide
(issue 25, item 21): distributed refit to SGLang is wired (so the docs must not say it is not),
and the GPU recipe's `--dp-size 4` server cannot take a distributed refit (SGLang asserts
`dp_size == 1` there), which the recipe's distributed-refit variant must say."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_distributed_refit_is_documented_as_wired():
    from verst.trainer.sync.modes import WEIGHT_SYNCS

    assert WEIGHT_SYNCS.config_class("distributed")  # the mode exists and is selectable
    training = (DOCS / "training.md").read_text()
    assert not re.search(r"not wired", training), "docs/training.md says a wired mode is not wired"


def test_gpu_recipe_says_distributed_refit_needs_dp_size_1():
    recipe = (DOCS / "gpu-recipe.md").read_text()
    variant = recipe[recipe.index("**Distributed refit**") :].split("\n* ")[0]
    assert "dp_size == 1" in variant and "--dp-size 1" in variant, variant
