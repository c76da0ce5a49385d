"""The configuration reference in docs/ matches the schemas."""

import importlib.util
import re
import typing
from pathlib import Path

from verst.trainer.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location(
        "gen_config_reference", ROOT / "scripts" / "gen_config_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_are_current():
    gen = load_generator()
    doc = gen.DOC.read_text(encoding="utf-8")
    assert gen.render(doc) == doc, (
        "docs/configuration.md is stale: run `uv run python scripts/gen_config_reference.py`"
    )


def leaf_fields(model, prefix=""):
    for name, field in model.model_fields.items():
        sub = field.annotation
        optional = [a for a in typing.get_args(sub) if a is not type(None)]
        if len(optional) == 1 and isinstance(optional[0], type) and hasattr(optional[0], "model_fields"):
            sub = optional[0]  # an optional section, e.g. train.lora
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            yield from leaf_fields(sub, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_every_field_is_documented():
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"`([a-z_<>.]+)`", doc))

    def is_documented(key):
        return any(key == token or key.endswith("." + token) for token in documented)

    missing = [key for key in leaf_fields(RunConfig) if not is_documented(key)]
    assert not missing, f"fields missing from docs/configuration.md: {missing}"
