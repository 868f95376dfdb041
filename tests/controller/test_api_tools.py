"""Tool calling through the official openai client against a real uvicorn server over the scripted backend
(whose reply is set per test, one token per stream delta): the tools reach the prompt, ``required`` and a named
function reach the backend as a grammar, replies are read into ``tool_calls`` (streamed as OpenAI's deltas, which
the client accumulates into the answer not streamed) with ``finish_reason: tool_calls``, and the follow-up turn
with ``tool`` messages is accepted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

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
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
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


def test_a_cut_forced_call_keeps_its_arguments_so_far_with_finish_length(
    oai: openai.OpenAI, backend: ScriptedBackend
) -> None:
    backend.reply = '{"city": "Oslo and more"}'
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=3)
    choice = reply.choices[0]
    [(_, name, arguments)] = _call_texts(choice.message.tool_calls)
    assert choice.finish_reason == "length" and choice.message.content is None
    assert name == "get_weather" and arguments.startswith("{") and backend.reply.startswith(arguments)
    assert arguments != backend.reply
    content, calls, finish = _streamed(
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=3, stream=True
        )
    )
    assert (content, finish) == ("", "length")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", arguments)]


STREAMED_REPLIES: list[tuple[Any, str]] = [
    ("auto", HERMES),
    (
        "auto",
        'A<tool_call>{"name":"add","arguments":{"a":1,"b":[2,"}"]}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> ok',
    ),
    ("auto", "No tools needed: 2 < 3, and <tool"),
    ("auto", '<tool_call>{"name": 5}</tool_call> is not a call'),
    ("none", HERMES),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "add", "parameters": {"a": 1}}]'),
    (NAMED, '{"city": "Oslo"}'),
    (NAMED, "not an object"),
]


@pytest.mark.parametrize(("tool_choice", "reply"), STREAMED_REPLIES)
def test_a_stream_accumulates_to_the_answer_not_streamed(
    oai: openai.OpenAI, backend: ScriptedBackend, tool_choice: Any, reply: str
) -> None:
    """The official client's accumulation of the stream equals the answer not streamed, and each call comes
    as OpenAI streams it: a delta with its id, type and name and empty arguments, then argument fragments."""
    backend.reply = reply
    answer = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice)
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    deltas = []
    stream = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, stream=True
    )
    for chunk in stream:
        list(state.handle_chunk(chunk))
        deltas += [call for choice in chunk.choices for call in choice.delta.tool_calls or []]
    streamed = state.get_final_completion().choices[0]
    expected = answer.choices[0]
    assert streamed.finish_reason == expected.finish_reason
    assert (streamed.message.content or "") == (expected.message.content or "")
    calls = _call_texts(expected.message.tool_calls)
    assert _call_texts(streamed.message.tool_calls) == calls
    assert (expected.finish_reason == "tool_calls") is bool(calls)
    for index, (_, name, arguments) in enumerate(calls):
        first, *rest = [d.model_dump() for d in deltas if d.index == index]
        assert first["id"] and first["type"] == "function" and first["function"] == {"name": name, "arguments": ""}
        assert all(d["id"] is None and d["type"] is None and d["function"]["name"] is None for d in rest)
        assert len(rest) > 1 and "".join(d["function"]["arguments"] for d in rest) == arguments


def _call_texts(calls: Any) -> list[tuple[str, str, str]]:
    """Type, name and arguments of each of a message's tool calls."""
    return [(call.type, call.function.name, call.function.arguments) for call in calls or []]


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
