"""The torch-free tokenizer matches transformers' AutoTokenizer; incremental detokenizing and stop strings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dejavu_common.tokenizer import Tokenizer, TokenizerError
from engine.tiny_models import FAMILIES

os.environ["HF_HUB_OFFLINE"] = "1"

TEXTS = [
    "Hello world!",
    "  leading spaces, trailing space ",
    "DejaVu streams the KV cache. It's fault-tolerant; isn't it?",
    "héllo wörld 日本語 🙂🙂 12345",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is two plus two?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me about Paris 🙂"},
    ],
]


def assert_matches_transformers(folder: Path) -> None:
    ours, theirs = Tokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for messages in CHATS:
        for gen in (True, False):
            expected = theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            expected = expected["input_ids"] if hasattr(expected, "keys") else expected
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == list(expected)
    assert theirs.eos_token_id in ours.eos_token_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers_on_tiny_checkpoints(family: str, tiny_checkpoints: dict[str, Path]) -> None:
    assert_matches_transformers(tiny_checkpoints[family])


@pytest.mark.model
def test_matches_transformers_on_smollm2(smollm2: Path) -> None:
    assert_matches_transformers(smollm2)
    assert Tokenizer.from_pretrained(smollm2).eos_token_ids == frozenset({2})


def test_bos_conventions_per_family(tiny_checkpoints: dict[str, Path]) -> None:
    first = {f: Tokenizer.from_pretrained(tiny_checkpoints[f]).encode("Hello")[0] for f in FAMILIES}
    tok = Tokenizer.from_pretrained(tiny_checkpoints["llama"])
    assert first["llama"] == tok.token_to_id("<s>") and first["opt"] == tok.token_to_id("</s>")
    assert first["gpt2"] == first["bloom"] == tok.encode("Hello", add_special_tokens=False)[0]


def test_chat_template_raise_exception_becomes_tokenizer_error(tiny_checkpoints: dict[str, Path]) -> None:
    tok = Tokenizer.from_pretrained(tiny_checkpoints["gpt2"])
    with pytest.raises(TokenizerError, match="bad role"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_missing_tokenizer_file_raises(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("text", TEXTS[:4])
def test_detokenizer_deltas_concatenate_to_the_decoded_text(text: str, tiny_checkpoints: dict[str, Path]) -> None:
    tok = Tokenizer.from_pretrained(tiny_checkpoints["llama"])
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.detokenizer()
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) + detok.flush() == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)  # split UTF-8 characters are held back, never emitted


def test_stop_string_cuts_the_text_and_holds_back_possible_prefixes(tiny_checkpoints: dict[str, Path]) -> None:
    tok = Tokenizer.from_pretrained(tiny_checkpoints["gpt2"])
    ids = tok.encode("Hello world! The quick brown fox", add_special_tokens=False)
    detok = tok.detokenizer(stop=["quick", "zzz"])
    emitted = ""
    for token in ids:
        emitted += detok.push(token)
        assert "quick"[:2] not in emitted.removeprefix("Hello world! The ")  # no partial stop string leaks
        if detok.stopped:
            break
    assert detok.stopped and emitted == "Hello world! The "
    assert detok.push(ids[-1]) == "" and detok.flush() == ""


def test_held_back_prefix_is_released_when_it_does_not_complete(tiny_checkpoints: dict[str, Path]) -> None:
    tok = Tokenizer.from_pretrained(tiny_checkpoints["gpt2"])
    ids = tok.encode("Hello world", add_special_tokens=False)
    detok = tok.detokenizer(stop=["worldwide"])
    text = "".join(detok.push(i) for i in ids)
    assert not detok.stopped and text + detok.flush() == "Hello world"
    assert "world" not in text  # could have become "worldwide", so it waited for flush
