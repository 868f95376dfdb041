"""Structured outputs through the official openai client against a real uvicorn server over the scripted
backend: every way of asking for one reaches the backend as the one ``GrammarSpec``, and what the workers'
grammar engine would refuse is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from dejavu_common.messages import FinishReason, GrammarKind, GrammarSpec

from .conftest import API_KEY, MODEL, LiveServer, ScriptedBackend

DEADLINE_S = 30.0
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}}},
    "required": ["name"],
    "$defs": {"tag": {"type": "string", "pattern": "^[a-z]+$"}},
}
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def oai(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, timeout=DEADLINE_S, max_retries=0)


def _grammar(backend: ScriptedBackend, index: int = -1) -> GrammarSpec | None:
    return backend.requests[index].sampling.grammar


def test_response_format_json_schema_and_json_object(oai: openai.OpenAI, backend: ScriptedBackend) -> None:
    oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
    )
    grammar = _grammar(backend)
    assert grammar is not None and grammar.kind is GrammarKind.JSON_SCHEMA and json.loads(grammar.source) == SCHEMA
    oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, response_format={"type": "json_object"})
    assert _grammar(backend) == GrammarSpec(kind=GrammarKind.JSON_OBJECT)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, stream=True, n=2, response_format={"type": "json_object"}
        )
    )
    assert chunks[-1].choices[0].finish_reason is not None
    assert _grammar(backend, -1) == _grammar(backend, -2) == GrammarSpec(kind=GrammarKind.JSON_OBJECT)  # each choice
    oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, response_format={"type": "text"})
    assert _grammar(backend) is None


def test_vllm_guided_fields_on_both_endpoints(oai: openai.OpenAI, backend: ScriptedBackend) -> None:
    cases: list[tuple[dict[str, Any], GrammarSpec]] = [
        ({"guided_json": SCHEMA}, GrammarSpec(kind=GrammarKind.JSON_SCHEMA, source=json.dumps(SCHEMA))),
        ({"guided_json": json.dumps(SCHEMA)}, GrammarSpec(kind=GrammarKind.JSON_SCHEMA, source=json.dumps(SCHEMA))),
        ({"guided_regex": r"\d{3}-[a-z]+"}, GrammarSpec(kind=GrammarKind.REGEX, source=r"\d{3}-[a-z]+")),
        ({"guided_choice": ["yes", "no"]}, GrammarSpec(kind=GrammarKind.CHOICE, choices=("yes", "no"))),
        ({"structured_outputs": {"choice": ["a", "b"]}}, GrammarSpec(kind=GrammarKind.CHOICE, choices=("a", "b"))),
        ({"structured_outputs": {"json_object": True}}, GrammarSpec(kind=GrammarKind.JSON_OBJECT)),
        ({"structured_outputs": {"regex": "x+"}}, GrammarSpec(kind=GrammarKind.REGEX, source="x+")),
    ]
    for extra, expected in cases:
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=extra)
        assert _grammar(backend) == expected, extra
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
        assert _grammar(backend) == expected, extra
    oai.completions.create(
        model=MODEL, prompt="Hi", max_tokens=4, extra_body={"response_format": {"type": "json_object"}}
    )
    assert _grammar(backend) == GrammarSpec(kind=GrammarKind.JSON_OBJECT)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": {"type": "strin"}}, "guided_json", "unknown type 'strin'"),
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 2}}, "guided_json", "minimum 5 is above"),
        ({"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json", "does not point inside"),
        ({"guided_json": {"type": "string", "pattern": "(?<=a)b"}}, "guided_json", "not supported"),
        ({"guided_regex": "(a|b"}, "guided_regex", "invalid regular expression"),
        ({"guided_regex": r"(a)\1"}, "guided_regex", "not supported"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar", "not supported"),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs", "does not support grammar"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "one structured output"),
    ],
)
def test_what_the_grammar_engine_refuses_is_a_400(
    oai: openai.OpenAI, backend: ScriptedBackend, extra: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
    body: dict[str, Any] = caught.value.body  # type: ignore[assignment]
    assert body["param"] == param and words in body["message"], body
    assert backend.requests == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_a_grammar_the_last_stage_refuses_is_a_400_before_anything_is_sent(
    oai: openai.OpenAI, backend: ScriptedBackend, stream: bool, n: int
) -> None:
    """What the gateway's own checks let through but the workers' grammar engine refuses comes back as the
    request's first event (REFUSED, with xgrammar's reason): a 400 then, streamed or not, every choice closed."""
    backend.fail_after, backend.fail_reason = 0, FinishReason.REFUSED
    backend.refusal = "Regex parsing error at position 1: Word boundary is not supported"
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, n=n, stream=stream, extra_body={"guided_regex": r"\bfoo"}
        )
    body: dict[str, Any] = caught.value.body  # type: ignore[assignment]
    assert body["code"] == "invalid_grammar" and "regex grammar" in body["message"], body
    assert "Word boundary is not supported" in body["message"]
    assert len(backend.requests) == n and backend.active == 0
