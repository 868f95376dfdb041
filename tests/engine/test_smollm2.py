"""The real default model: greedy tokens equal transformers' generate, for 1, 2, 3 and 5 stages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dejavu_common.tokenizer import Tokenizer
from dejavu_engine.generate import Request, generate_batch
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.stopping import StopCriteria

os.environ["HF_HUB_OFFLINE"] = "1"
pytestmark = pytest.mark.model

NEW_TOKENS = 16
PLAIN = ["The capital of France is", "def fibonacci(n):"]
CHAT = ["What is the tallest mountain on Earth?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def cases(smollm2: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, HF greedy continuation) per prompt; the HF model is loaded once."""
    tok = Tokenizer.from_pretrained(smollm2)
    prompts = [tok.encode(p) for p in PLAIN] + [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
    model = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            generated = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            out.append((ids, generated[0, len(ids) :].tolist()))
    return out


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
def test_greedy_tokens_equal_transformers_generate(
    stages: int, smollm2: Path, cases: list[tuple[list[int], list[int]]]
) -> None:
    pipeline = Pipeline(smollm2, stages)
    eos = pipeline.spec.eos_token_ids
    for prompt, expected in cases:
        (completion,), _ = generate_batch(pipeline, [Request(tuple(prompt), StopCriteria(NEW_TOKENS, eos))])
        assert list(completion.token_ids) == expected
