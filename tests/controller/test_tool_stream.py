"""The tool-call reader on its own: replies fed in every split give the same content and calls, calls stream as
OpenAI's deltas (the name as soon as the head is complete, the arguments' text as it comes, only what could
still be markup held back), and what only starts like a call stays content."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from dejavu_controller.api.schemas.chat import ChatCompletionRequest, ToolCallDelta
from dejavu_controller.api.tool_calls import Piece, ToolCallReader

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "add", "f")
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HERMES = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
NESTED = '{"a":1,"b":{"c":[2,"}]\\"{"]},"d":"</b>"}'

# (tool_choice, reply, content, [(name, arguments)], cut)
CASES: list[tuple[Any, str, str, list[tuple[str, str]], bool]] = [
    ("auto", HERMES, "Let me check.", [("get_weather", '{"city": "Paris"}')], False),
    (
        "auto",
        f'A<tool_call>{{"name":"add","arguments":{NESTED}}}</tool_call>\n'
        '<tool_call> {"name": "f", "parameters": {} } </tool_call> done.',
        "A\n done.",
        [("add", NESTED), ("f", "{}")],
        False,
    ),
    ("auto", "No tools needed: 2 < 3, and <tool", "No tools needed: 2 < 3, and <tool", [], False),
    ("auto", "See <tool_call>not json</tool_call> ok", "See <tool_call>not json</tool_call> ok", [], False),
    ("auto", '<tool_call>{"name": 5}</tool_call>', '<tool_call>{"name": 5}</tool_call>', [], False),
    ("auto", 'x <tool_call>{"nam', 'x <tool_call>{"nam', [], False),
    # another key order, and arguments written as a string: read whole at the end tag
    ("auto", '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>', "", [("add", '{"a": 1}')], False),
    ("auto", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>', "", [("add", '{"a": 2}')], False),
    ("auto", '<tool_call>{"name": "add", "arguments": {"a": 1}}', "", [("add", '{"a": 1}')], False),  # EOS, no tag
    ("auto", 'x<tool_call>{"name": "add", "arguments": {"a": 1', "x", [("add", '{"a": 1')], True),
    ("auto", 'x<tool_call>{"name": "add", "arguments": {"a": "</tool', "x", [("add", '{"a": "</tool')], True),
    # an end tag ends the block wherever it is (vLLM's Hermes reading): the call keeps what came before it
    (
        "auto",
        '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>',
        '"}}</tool_call>',
        [("f", '{"s": "')],
        False,
    ),
    ("none", HERMES, HERMES, [], False),
    (NAMED, '{"city": "Oslo"}', "", [("get_weather", '{"city": "Oslo"}')], False),
    (NAMED, ' \n{"city": "Oslo"} \n', "", [("get_weather", '{"city": "Oslo"}')], False),
    (NAMED, NESTED, "", [("get_weather", NESTED)], False),
    (NAMED, "not json", "not json", [], False),
    (NAMED, "  ", "  ", [], False),
    (NAMED, '{"city": "Os', "", [("get_weather", '{"city": "Os')], True),
    (
        "required",
        '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "add", "parameters": {"a": 1}}]',
        "",
        [("get_weather", '{"city": "Rome"}'), ("add", '{"a": 1}')],
        False,
    ),
    (
        "required",
        f'[{{"name":"add","parameters":{NESTED}}},{{"name":"f","parameters":{{}},"x":[1,"]"]}}]\n',
        "",
        [("add", NESTED), ("f", "{}")],
        False,
    ),
    ("required", '[{"parameters": {"a": 1}, "name": "add"}]', "", [("add", '{"a": 1}')], False),
    (
        "required",
        '[{"name": "add", "parameters": {"a": 1}}, {"parameters": {}, "name": "f"}]',
        "",
        [("add", '{"a": 1}'), ("f", "{}")],
        False,
    ),
    ("required", "sorry", "sorry", [], False),
    ("required", '[{"name": "ad', '[{"name": "ad', [], False),
    ("required", '[{"name": "add", "parameters": {"a": ', "", [("add", '{"a": ')], True),
]


def _body(tool_choice: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": tool_choice}
    )


def _read(tool_choice: Any, chunks: list[str]) -> tuple[list[Piece], ToolCallReader]:
    reader = ToolCallReader(_body(tool_choice))
    pieces = [piece for text in chunks for piece in reader.push(text)]
    return pieces + reader.finish(), reader


def _accumulated(pieces: list[Piece]) -> tuple[str, list[tuple[str, str]]]:
    """Content and calls as a client accumulates the deltas (by index), checking each delta's shape."""
    content, calls = "", list[tuple[str, str]]()
    for piece in pieces:
        if isinstance(piece, str):
            content += piece
            continue
        if piece.index == len(calls):  # a call's first delta: its id, type and name, no arguments yet
            assert piece.id and piece.id.startswith("call_") and piece.type == "function" and piece.function.name
            assert piece.function.arguments == ""
            calls.append((piece.function.name, ""))
        else:  # the next ones: only the index and the next fragment of the arguments
            assert piece.index == len(calls) - 1 and piece.function.arguments
            assert piece.model_dump() == {"index": piece.index, "function": {"arguments": piece.function.arguments}}
            calls[-1] = (calls[-1][0], calls[-1][1] + piece.function.arguments)
    return content, calls


def _splits(text: str) -> Iterator[list[str]]:
    """The reply whole, split in two at every point, split at every character, and in random pieces."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(text)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(("tool_choice", "reply", "content", "calls", "cut"), CASES)
def test_every_split_of_a_reply_reads_the_same(
    tool_choice: Any, reply: str, content: str, calls: list[tuple[str, str]], cut: bool
) -> None:
    for chunks in _splits(reply):
        pieces, reader = _read(tool_choice, chunks)
        assert _accumulated(pieces) == (content, calls), chunks
        assert [(c.function.name, c.function.arguments) for c in reader.calls] == calls
        assert reader.cut is cut


def test_a_call_streams_its_name_first_then_its_arguments_as_they_come() -> None:
    reader = ToolCallReader(_body("auto"))
    assert reader.push("Sure.<tool_") == ["Sure."]
    assert reader.push('call>\n{"name": "get_weather", "argu') == []  # could still be something else
    assert reader.push('ments": ') == []  # the arguments may still not be an object
    start, first = reader.push('{"city": "Pa')
    assert isinstance(start, ToolCallDelta) and start.id and start.id.startswith("call_")
    assert start.model_dump(exclude={"id"}) == {
        "index": 0,
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert _args([first]) == ['{"city": "Pa']
    assert _args(reader.push('ris", "note": "a<')) == ['ris", "note": "a']  # "<" could begin the end tag
    assert _args(reader.push('b"}')) == ['<b"}']  # the arguments end here: the rest is the call's markup
    assert reader.push("}\n</tool_call>\nDone") == ["\nDone"]
    assert reader.finish() == []
    [call] = reader.calls
    assert json.loads(call.function.arguments) == {"city": "Paris", "note": "a<b"}


def test_forced_calls_stream_from_the_first_token() -> None:
    named = ToolCallReader(_body(NAMED))
    start, first = named.push(' {"ci')
    assert isinstance(start, ToolCallDelta) and start.function.name == "get_weather"
    assert _args([first]) == ['{"ci']
    assert _args(named.push('ty": "Oslo"}')) == ['ty": "Oslo"}']
    assert named.push("\n") == [] and named.finish() == []
    required = ToolCallReader(_body("required"))
    assert required.push('[{"name": "add", "parameters": ') == []
    start, first = required.push('{"a"')
    assert isinstance(start, ToolCallDelta) and start.function.name == "add" and _args([first]) == ['{"a"']
    assert _args(required.push(': 1}}, {"name": "f", "para')) == [": 1}"]
    assert [p.function.name for p in required.push('meters": {}}]') if isinstance(p, ToolCallDelta)] == ["f", None]


def _args(pieces: list[Piece]) -> list[str]:
    """The argument fragments among ``pieces`` (a call's first delta, which has none, left out)."""
    return [p.function.arguments for p in pieces if isinstance(p, ToolCallDelta) and p.function.name is None]
