"""Model families the engine implements, keyed by config.json's ``model_type``."""

from __future__ import annotations

from typing import Any

from dejavu_engine.families.bloom import Bloom
from dejavu_engine.families.gemma import Gemma2, Gemma3Text
from dejavu_engine.families.gpt2 import GPT2
from dejavu_engine.families.llama import Llama
from dejavu_engine.families.mistral import Mistral
from dejavu_engine.families.opt import OPT
from dejavu_engine.families.phi3 import Phi3
from dejavu_engine.families.qwen2 import Qwen2
from dejavu_engine.families.qwen3 import Qwen3
from dejavu_engine.family import Family

FAMILIES: dict[str, type[Family]] = {
    "llama": Llama,
    "mistral": Mistral,
    "qwen2": Qwen2,
    "qwen3": Qwen3,
    "phi3": Phi3,
    "gemma2": Gemma2,
    "gemma3_text": Gemma3Text,
    "opt": OPT,
    "gpt2": GPT2,
    "bloom": Bloom,
}

_MOE = "a mixture-of-experts MLP (routed experts)"
_GEMMA = "Gemma 1's layer (Gemma 2's without its post-attention and feed-forward norms)"
# What the engine lacks for model types people serve that it does not implement.
MISSING: dict[str, str] = {
    "mixtral": _MOE,
    "qwen2_moe": _MOE,
    "qwen3_moe": _MOE,
    "phimoe": _MOE,
    "olmoe": _MOE,
    "deepseek_v2": f"{_MOE} and multi-head latent attention",
    "deepseek_v3": f"{_MOE} and multi-head latent attention",
    "gemma": _GEMMA,
    "gemma3": "Gemma 3's vision tower (its text model, model_type gemma3_text, is supported)",
    "phi": "Phi-1/2's layer (parallel attention and MLP, a partial rotary embedding, LayerNorm)",
}


def family_for(config: dict[str, Any]) -> Family:
    """The family of a config.json; raises ValueError naming what is missing for an unsupported ``model_type``
    (or, from the family, an unsupported option of a supported one)."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        missing = f": the engine lacks {MISSING[model_type]}" if model_type in MISSING else ""
        raise ValueError(f"unsupported model_type {model_type!r}{missing}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type](config)
