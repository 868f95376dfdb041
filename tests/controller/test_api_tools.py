"""Tool calling through the official openai client against a real uvicorn server over the scripted backend
(whose reply is set per test): the tools reach the prompt, ``required`` and a named function reach the backend
as a grammar, replies are read into ``tool_calls`` (streamed and not) with ``finish_reason: tool_calls``, and
the follow-up turn with ``tool`` messages is accepted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from dejavu_common.messages import GrammarKind
from dejavu_common.settings import Settings
from dejavu_controller.api.schemas.chat import ChatMessage

from .conftest import API_KEY, MODEL, LiveServer, ScriptedBackend, make_settings

DEADLINE_S = 30.0
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}
TOOLS: list[Any] = [WEATHER, ADD]
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def settings(tokenizer_dir: Path) -> Settings:
    """Room for the tools' definitions in the prompt (the test tokenizer spends a token per few characters)."""
    return make_settings(tokenizer_dir, max_context=4096)


@pytest.fixture
def oai(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, timeout=DEADLINE_S, max_retries=0)


def _prompt(backend: ScriptedBackend) -> str:
    return backend.tokenizer.decode(list(backend.requests[-1].prompt_token_ids), skip_special_tokens=False)


def _streamed(stream: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """Content, tool calls (accumulated by index) and finish reason of a streamed single choice."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                got = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                got["name"] += call.function.name or ""
                got["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_auto_reads_hermes_calls_streamed_and_not(oai: openai.OpenAI, backend: ScriptedBackend) -> None:
    backend.reply = HERMES
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
    assert "<tools>" in _prompt(backend) and '"name": "get_weather"' in _prompt(backend)
    assert backend.requests[-1].sampling.grammar is None  # auto is free text
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    content, calls, finish = _streamed(
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True)
    )
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_without_a_call_is_plain_content(oai: openai.OpenAI, backend: ScriptedBackend, stream: bool) -> None:
    backend.reply = "No tools needed: 2 < 3, and <tool"  # ends with what could begin a tag
    if stream:
        content, calls, finish = _streamed(
            oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True)
        )
    else:
        reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
        content, calls, finish = reply.choices[0].message.content, reply.choices[0].message.tool_calls or [], None
        finish = reply.choices[0].finish_reason
    assert (content, calls, finish) == (backend.reply, [], "stop")


def test_required_is_enforced_by_a_grammar_and_read_into_calls(oai: openai.OpenAI, backend: ScriptedBackend) -> None:
    backend.reply = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "add", "parameters": {"a": 1}}]'
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required")
    grammar = backend.requests[-1].sampling.grammar
    assert grammar is not None and grammar.kind is GrammarKind.JSON_SCHEMA
    schema = json.loads(grammar.source)
    assert schema["type"] == "array" and schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == ADD["function"]["parameters"]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    assert calls == [("get_weather", {"city": "Rome"}), ("add", {"a": 1})]
    oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    assert json.loads(backend.requests[-1].sampling.grammar.source)["maxItems"] == 1  # type: ignore[union-attr]


def test_a_named_function_is_its_arguments_streamed_and_not(oai: openai.OpenAI, backend: ScriptedBackend) -> None:
    backend.reply = '{"city": "Oslo"}'
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named)
    grammar = backend.requests[-1].sampling.grammar
    assert grammar is not None and json.loads(grammar.source) == WEATHER["function"]["parameters"]  # type: ignore[index]
    [call] = reply.choices[0].message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    assert reply.choices[0].finish_reason == "tool_calls"
    content, calls, finish = _streamed(
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named, stream=True)
    )
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_a_cut_forced_call_is_content_with_finish_length(oai: openai.OpenAI, backend: ScriptedBackend) -> None:
    backend.reply = '{"city": "Oslo and more"}'
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=3)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls and choice.message.content


def test_none_offers_no_tools_and_reads_no_calls(oai: openai.OpenAI, backend: ScriptedBackend) -> None:
    backend.reply = HERMES
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none")
    assert "<tools>" not in _prompt(backend)
    assert reply.choices[0].message.content == HERMES and reply.choices[0].finish_reason == "stop"


def test_the_follow_up_turn_with_tool_messages(oai: openai.OpenAI, backend: ScriptedBackend) -> None:
    backend.reply = "It is sunny in Paris."
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]
    reply = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert reply.choices[0].message.content == "It is sunny in Paris." and reply.choices[0].finish_reason == "stop"
    prompt = _prompt(backend)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in prompt


def test_a_template_that_renders_tools_gets_them_as_they_are() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    message = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]})
    assert message.as_template_message(template_takes_tools=True) == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
    }
    answer = ChatMessage.model_validate({"role": "tool", "tool_call_id": "c", "content": "2"})
    assert answer.as_template_message(template_takes_tools=True) == {
        "role": "tool",
        "content": "2",
        "tool_call_id": "c",
    }


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ],
)
def test_bad_tool_requests_are_400s(
    oai: openai.OpenAI, backend: ScriptedBackend, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=extra)
    body: dict[str, Any] = caught.value.body  # type: ignore[assignment]
    assert body["param"] == param, body
    assert backend.requests == []
