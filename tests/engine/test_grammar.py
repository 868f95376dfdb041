"""Structured outputs on the real default model: a grammar's rows produce only what it allows, end where it is
complete, and a row whose matcher is rebuilt from its tokens (a resumed row) samples the same tokens."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from dejavu_common.messages import FinishReason, GrammarKind, GrammarSpec, SamplingSpec
from dejavu_common.tokenizer import Tokenizer
from dejavu_engine import generate as generate_module
from dejavu_engine import grammar
from dejavu_engine.generate import Request, generate_batch
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.sampling import RowContext, sample_rows

os.environ["HF_HUB_OFFLINE"] = "1"
pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
}


@pytest.fixture(scope="module")
def pipeline(smollm2: Path) -> Pipeline:
    return Pipeline(smollm2, 1, "cpu")


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2)


def _chat(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def _run(
    pipeline: Pipeline, tokenizer: Tokenizer, prompt: tuple[int, ...], spec: GrammarSpec, seeds: list[int | None]
) -> list[tuple[str, FinishReason]]:
    requests = [
        Request(
            prompt,
            SamplingSpec(max_tokens=80, temperature=0 if seed is None else 0.7, seed=seed, grammar=spec),
            tokenizer.eos_token_ids,
        )
        for seed in seeds
    ]
    done, _ = generate_batch(pipeline, requests)
    return [(tokenizer.decode(c.token_ids), c.finish_reason) for c in done]


def test_json_schema_rows_produce_only_valid_json_and_end_there(pipeline: Pipeline, tokenizer: Tokenizer) -> None:
    spec = GrammarSpec(kind=GrammarKind.JSON_SCHEMA, source=json.dumps(PERSON))
    prompt = _chat(tokenizer, "Describe a person as JSON with a name, an age and a city.")
    for text, reason in _run(pipeline, tokenizer, prompt, spec, [None, 1, 2, 3]):
        assert reason is FinishReason.STOP, text  # the grammar completed and allowed EOS, which ended the row
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_regex_and_choice(pipeline: Pipeline, tokenizer: Tokenizer) -> None:
    prompt = _chat(tokenizer, 'Answer as a JSON object {"answer": ...}: what is 6 times 7?')
    rows = _run(pipeline, tokenizer, prompt, GrammarSpec(kind=GrammarKind.JSON_OBJECT), [None, 7])
    for (text, reason), seed in zip(rows, [None, 7], strict=True):
        if reason is FinishReason.LENGTH and seed is not None:  # a sampled object may run past max_tokens
            assert text.startswith("{"), text
            continue
        assert reason is FinishReason.STOP and isinstance(json.loads(text), dict), text
    prompt = _chat(tokenizer, "Give me a phone number, then say whether the sky is blue.")
    regex = GrammarSpec(kind=GrammarKind.REGEX, source=r"\(\d{3}\) \d{3}-\d{4}")
    for text, reason in _run(pipeline, tokenizer, prompt, regex, [None, 8]):
        assert reason is FinishReason.STOP and re.fullmatch(regex.source, text), text
    choice = GrammarSpec(kind=GrammarKind.CHOICE, choices=("yes", "no", 'it "depends"\n'))
    for text, reason in _run(pipeline, tokenizer, prompt, choice, [None, 9, 10]):
        assert reason is FinishReason.STOP and text in choice.choices, text


def test_a_grammar_that_does_not_compile_refuses_its_row_only(pipeline: Pipeline, tokenizer: Tokenizer) -> None:
    """The row of a grammar xgrammar refuses ends REFUSED without a token, saying why; the row batched beside it
    samples as it would alone."""
    bad = GrammarSpec(kind=GrammarKind.REGEX, source="(?<=a)b")  # lookbehind: xgrammar refuses it
    with pytest.raises(grammar.GrammarError, match="Lookbehind"):
        grammar.compile_source(bad)
    good = GrammarSpec(kind=GrammarKind.REGEX, source="(yes|no)")
    prompt = _chat(tokenizer, "Hi")
    spec = SamplingSpec(max_tokens=8, temperature=0, grammar=bad)
    fine = spec.model_copy(update={"grammar": good})
    logits = torch.zeros(2, pipeline.stages[-1].spec.vocab_size)
    rows = sample_rows(logits, [spec, fine], [0, 0], [RowContext(prompt)] * 2)
    assert rows[0].token == -1 and "Lookbehind" in (rows[0].refused or "")
    assert rows[1].refused is None and rows[1].token >= 0
    eos = tokenizer.eos_token_ids
    done, _ = generate_batch(pipeline, [Request(prompt, spec, eos), Request(prompt, fine, eos)])
    assert (done[0].token_ids, done[0].finish_reason) == ((), FinishReason.REFUSED)
    assert tokenizer.decode(done[1].token_ids) in ("yes", "no") and done[1].finish_reason is FinishReason.STOP


def test_a_row_whose_matcher_is_rebuilt_from_its_tokens_samples_the_same_tokens(
    pipeline: Pipeline, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sampler's calls of a seeded constrained run, replayed with the matcher caches emptied at a
    mid-stream step (a resumed row: its matcher rebuilt from the tokens so far) and before every step."""
    calls: list[tuple[torch.Tensor, list[SamplingSpec], list[int], list[RowContext]]] = []
    real = sample_rows

    def recording(logits: torch.Tensor, params: Any, steps: Any, contexts: Any = None) -> Any:
        calls.append((logits.clone(), list(params), list(steps), list(contexts)))
        return real(logits, params, steps, contexts)

    monkeypatch.setattr(generate_module, "sample_rows", recording)
    spec = GrammarSpec(kind=GrammarKind.JSON_SCHEMA, source=json.dumps(PERSON))
    prompt = _chat(tokenizer, "Describe a person as JSON.")
    request = Request(
        prompt, SamplingSpec(max_tokens=80, temperature=1.2, seed=5, grammar=spec), tokenizer.eos_token_ids
    )
    [done], _ = generate_batch(pipeline, [request])
    jsonschema.validate(json.loads(tokenizer.decode(done.token_ids)), PERSON)
    assert len(calls) == len(done.token_ids) > 6
    for resume_at in (len(calls) // 2, 0):
        grammar.clear()
        for step, (logits, params, steps, contexts) in enumerate(calls):
            if step < resume_at:
                continue
            if resume_at == 0:
                grammar.clear()  # every step rebuilds the matcher from the generated tokens
            [row] = real(logits, params, steps, contexts)
            assert row.token == done.token_ids[step]
