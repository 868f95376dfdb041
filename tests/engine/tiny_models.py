"""Tiny random-weight checkpoints of each supported family, with a small trained BPE tokenizer.

Each checkpoint folder is what the engine reads in production: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json and the family's own chat template (written by transformers' own
``save_pretrained``). ``ROPE_VARIANTS`` are Llama and Phi-3 checkpoints with scaled rotary embeddings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN_PRETOKENIZE_REGEX

FAMILIES = ("llama", "opt", "gpt2", "bloom", "mistral", "qwen2", "qwen3", "phi3")
VOCAB = 384
LAYERS = 3
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "DejaVu streams the KV cache between pipeline stages, layer by layer.",
    "Hello world! Fault tolerance means replicas of the cache survive a failed worker.",
    "héllo wörld, 日本語のテキスト, emoji 🙂 and numbers 12345.",
    "user: what is two plus two? assistant: four.",
]
# A chat template in the style of real checkpoints: uses bos_token, eos_token and raise_exception.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The newer families' own templates (abridged from their published checkpoints), each with its special tokens.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] in ['system', 'user', 'assistant'] %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system_message = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}"
    "{{ bos_token }}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{% if loop.first and system_message is defined %}"
    "{{ '[INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)
# family -> (BOS the tokenizer prepends, EOS token, chat template, added special tokens)
_TOKENIZERS: dict[str, tuple[str | None, str, str, tuple[str, ...]]] = {
    "llama": ("<s>", "</s>", CHAT_TEMPLATE, ()),
    "opt": ("</s>", "</s>", CHAT_TEMPLATE, ()),
    "gpt2": (None, "</s>", CHAT_TEMPLATE, ()),
    "bloom": (None, "</s>", CHAT_TEMPLATE, ()),
    "mistral": ("<s>", "</s>", MISTRAL_TEMPLATE, ("[INST]", "[/INST]")),
    "qwen2": (None, "<|im_end|>", CHATML_TEMPLATE, ("<|im_start|>", "<|im_end|>")),
    "qwen3": (None, "<|im_end|>", CHATML_TEMPLATE, ("<|im_start|>", "<|im_end|>")),
    "phi3": ("<s>", "<|end|>", PHI3_TEMPLATE, ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")),
}
# Scaled rotary embeddings: name -> (family, config overrides). Small pretraining lengths, so that a test's
# positions cross them: ``dynamic`` rescales past 8 positions, ``longrope`` takes its long factors past 10.
ROPE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "dynamic": (
        "llama",
        {
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
            "max_position_embeddings": 8,
        },
    ),
    "llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "yarn": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "longrope": (
        "phi3",
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
                "long_factor": [1.0, 1.3, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0],
            },
            "original_max_position_embeddings": 10,
        },
    ),
}


def _config(family: str, overrides: dict[str, Any] | None = None) -> PretrainedConfig:
    common: dict[str, Any] = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if family in _LLAMA_SHAPED:
        config_class, extra = _LLAMA_SHAPED[family]
        fields = {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
        }
        return config_class(**(fields | extra | common | (overrides or {})))
    if overrides:
        raise ValueError(f"{family}: config overrides are for the Llama-shaped families")
    if family == "opt":
        return OPTConfig(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
            do_layer_norm_before=True,
            **common,
        )
    if family == "gpt2":
        return GPT2Config(n_embd=64, n_layer=LAYERS, n_head=4, n_positions=256, **common)
    if family == "bloom":
        return BloomConfig(hidden_size=64, n_layer=LAYERS, n_head=4, **common)
    raise ValueError(family)


# Llama-shaped families: config class and what each sets apart from Llama's tiny shape. Qwen3's head_dim (32)
# is not hidden / heads (16), as in its real checkpoints; Phi-3's KV heads equal its q heads in Phi-3-mini, but
# grouped-query attention is the harder case; Mistral has no sliding window (as from v0.2 on).
_LLAMA_SHAPED: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "llama": (LlamaConfig, {}),
    "mistral": (MistralConfig, {"sliding_window": None}),
    "qwen2": (Qwen2Config, {"use_sliding_window": False}),
    "qwen3": (Qwen3Config, {"head_dim": 32, "use_sliding_window": False}),
    "phi3": (Phi3Config, {"original_max_position_embeddings": 256, "sliding_window": None}),
}
_MODELS: dict[str, type[PreTrainedModel]] = {
    "llama": LlamaForCausalLM,
    "opt": OPTForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "bloom": BloomForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
}


def _tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on CORPUS; BOS conventions, EOS token, chat template and the template's special
    tokens as the family's real tokenizers have them."""
    bos, eos, template, added = _TOKENIZERS[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if family.startswith("qwen"):  # Qwen's own pipeline, which transformers' Qwen2Tokenizer rebuilds as it loads
        tok.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    if bos is not None:  # Llama prepends <s>, OPT prepends </s>; GPT-2, BLOOM and Qwen add nothing
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos or ("<s>" if family in ("gpt2", "bloom") else None),
        eos_token=eos,
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=template,
    )
    fast.add_special_tokens({"additional_special_tokens": list(added)})
    return fast


def build_checkpoint(family: str, folder: Path, seed: int = 0, overrides: dict[str, Any] | None = None) -> Path:
    """Write a tiny random-weight float32 checkpoint of ``family`` (its config changed by ``overrides``) into
    ``folder``; return it."""
    torch.manual_seed(seed)
    model = _MODELS[family](_config(family, overrides)).to(torch.float32).eval()
    with torch.no_grad():  # random, not near-zero, weights so that differences would show
        for name, param in model.named_parameters():
            if "norm" not in name and "ln" not in name:
                param.normal_(0.0, 0.15)
            elif "q_norm" in name or "k_norm" in name:  # per-head norms: not all ones, so that they count
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    _tokenizer(family).save_pretrained(folder)
    return folder
