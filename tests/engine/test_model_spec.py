"""Every family reads its :class:`ModelSpec` from config.json as transformers reads the same config (its own key
names, GPT-2's and BLOOM's included, and its defaults for what the config omits); a config that lacks a fact, or
holds one as something other than a positive whole number, is refused naming the fact and its key."""

from __future__ import annotations

import re
from typing import Any

import pytest
from transformers import (
    BloomConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from dejavu_engine.families import family_for
from dejavu_engine.family import ModelSpec, eos_ids

# Shapes away from the class defaults where a family reads them: grouped heads, a head_dim that is not
# hidden // heads, untied or tied embeddings against the default, other position counts.
CONFIGS: list[PretrainedConfig] = [
    LlamaConfig(num_key_value_heads=8, head_dim=96, tie_word_embeddings=True, eos_token_id=[2, 7]),
    MistralConfig(num_key_value_heads=4),
    Qwen2Config(num_key_value_heads=4, max_position_embeddings=4096),
    Qwen3Config(num_key_value_heads=8, head_dim=64),
    Phi3Config(num_key_value_heads=8),
    Gemma2Config(tie_word_embeddings=False),
    Gemma3TextConfig(max_position_embeddings=32768),
    OPTConfig(num_hidden_layers=6, hidden_size=512, num_attention_heads=8, tie_word_embeddings=False),
    GPT2Config(n_layer=5, n_embd=96, n_head=6, n_positions=512),
    BloomConfig(n_layer=3, hidden_size=96, n_head=6),
]


def _transformers_spec(config: PretrainedConfig, max_positions: int) -> ModelSpec:
    """The spec as transformers' modelling code reads ``config`` (attribute_map aliases resolved by the config)."""
    heads = config.num_attention_heads
    return ModelSpec(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab_size=config.vocab_size,
        max_positions=max_positions,
        tie_word_embeddings=config.tie_word_embeddings,
        eos_token_ids=eos_ids(config.to_dict()),
    )


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.model_type)
def test_the_spec_is_the_config_as_transformers_reads_it(config: PretrainedConfig) -> None:
    spec = family_for(config.to_dict()).spec
    # BLOOM's config has no position count (ALiBi has no table); the engine's own bound stands for it.
    max_positions = spec.max_positions if config.model_type == "bloom" else config.max_position_embeddings
    assert spec == _transformers_spec(config, max_positions)


@pytest.mark.parametrize("config_class", [LlamaConfig, Gemma2Config])
def test_a_config_without_positions_or_tying_takes_transformers_defaults(config_class: type[PretrainedConfig]) -> None:
    """Llama's and Gemma's defaults differ (2048 positions, untied; 8192, tied): each family states its own."""
    omitted = {
        k: v for k, v in config_class().to_dict().items() if k not in ("max_position_embeddings", "tie_word_embeddings")
    }
    spec = family_for(omitted).spec
    expected = config_class.from_dict(omitted)
    assert (spec.max_positions, spec.tie_word_embeddings) == (
        expected.max_position_embeddings,
        expected.tie_word_embeddings,
    )


def _without(config: PretrainedConfig, key: str) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict().items() if k != key}


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        (_without(LlamaConfig(), "hidden_size"), "llama: config.json has no hidden size (hidden_size)"),
        (_without(GPT2Config(), "n_layer"), "gpt2: config.json has no layer count (n_layer)"),
        (_without(BloomConfig(), "hidden_size"), "bloom: config.json has no hidden size (hidden_size or n_embed)"),
        (_without(OPTConfig(), "max_position_embeddings"), "opt: config.json has no position count"),
        (
            Qwen2Config().to_dict() | {"num_attention_heads": 0},
            "qwen2: config.json has no attention head count (num_attention_heads)",
        ),
        (
            Gemma2Config().to_dict() | {"vocab_size": "256000"},
            "gemma2: config.json's vocabulary size is '256000', not a positive whole number",
        ),
        (
            Phi3Config().to_dict() | {"num_hidden_layers": True},
            "phi3: config.json's layer count is True, not a positive whole number",
        ),
        (
            LlamaConfig().to_dict() | {"head_dim": -64},
            "llama: config.json's head size is -64, not a positive whole number",
        ),
    ],
)
def test_a_config_lacking_a_fact_is_refused_naming_it(config: dict[str, Any], refusal: str) -> None:
    with pytest.raises(ValueError, match=re.escape(refusal)):
        family_for(config)
