"""Tiny random-weight checkpoints of each supported family, with a small trained BPE tokenizer.

Each checkpoint folder is what the engine reads in production: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json (written by transformers' own ``save_pretrained``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

FAMILIES = ("llama", "opt", "gpt2", "bloom")
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


def _config(family: str) -> PretrainedConfig:
    common = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if family == "llama":
        return LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            **common,
        )
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


_MODELS: dict[str, type[PreTrainedModel]] = {
    "llama": LlamaForCausalLM,
    "opt": OPTForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "bloom": BloomForCausalLM,
}


def _tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on CORPUS; BOS conventions as the family's real tokenizers have them."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    bos = {"llama": "<s>", "opt": "</s>"}.get(family)
    if bos is not None:  # Llama prepends <s>, OPT prepends </s>; GPT-2 and BLOOM add nothing
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos or "<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def build_checkpoint(family: str, folder: Path, seed: int = 0) -> Path:
    """Write a tiny random-weight float32 checkpoint of ``family`` into ``folder``; return it."""
    torch.manual_seed(seed)
    model = _MODELS[family](_config(family)).to(torch.float32).eval()
    with torch.no_grad():  # random, not near-zero, weights so that differences would show
        for name, param in model.named_parameters():
            if "norm" not in name and "ln" not in name:
                param.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    _tokenizer(family).save_pretrained(folder)
    return folder
