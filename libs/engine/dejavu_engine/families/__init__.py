"""Model families the engine implements, keyed by config.json's ``model_type``."""

from __future__ import annotations

from typing import Any

from dejavu_engine.families.bloom import Bloom
from dejavu_engine.families.gpt2 import GPT2
from dejavu_engine.families.llama import Llama
from dejavu_engine.families.opt import OPT
from dejavu_engine.family import Family

FAMILIES: dict[str, type[Family]] = {"llama": Llama, "opt": OPT, "gpt2": GPT2, "bloom": Bloom}


def family_for(config: dict[str, Any]) -> Family:
    """The family of a config.json; raises ValueError for an unsupported ``model_type``."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type](config)
