"""Reading a chat reply into OpenAI tool calls as it streams (:class:`ToolCallReader`).

A reply is read for the shape its ``tool_choice`` asks for (``dejavu_controller.api.tools``): ``auto``'s is free
text with Hermes ``<tool_call>`` blocks, each a JSON object ``{"name", "arguments"}``; ``required``'s a JSON
array of ``{"name", "parameters"}`` objects; a named function's that function's arguments object; ``none``'s
content only.

The reader releases pieces in the reply's order: content text, and tool-call deltas as OpenAI streams them (a
call's first delta carries its ``index``, ``id`` and name with empty arguments; the next ones carry only the
``index`` and the next fragment of the arguments' text). A call is known from its head, ``{"name": "<name>",
"arguments": {`` (``"parameters"`` too), so its name is released as soon as the head is complete and its
arguments object's text as it arrives, up to where that JSON value ends; only what could still begin the
``</tool_call>`` tag is held back. The closing of the call object is not argument text, and a ``</tool_call>``
ends a block wherever it appears (as vLLM's Hermes parser reads it). A call written another way (keys in
another order, arguments that are not an object) is held until it ends and read whole; a block, or a forced
answer, that is not a call stays content. What is released does not depend on how the reply is split into
deltas: the non-streamed answer is the concatenation of the streamed pieces.
"""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from .schemas.chat import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ChatCompletionRequest,
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
)

Piece = str | ToolCallDelta  # content text, or a delta of one of the reply's tool calls
_WS = " \t\n\r"  # JSON's whitespace
_NAME = None  # a head step: the function's name, a non-empty JSON string
_Step = str | tuple[str, ...] | None  # a literal, one of several literals, or the name
_HERMES_HEAD: tuple[_Step, ...] = ("{", '"name"', ":", _NAME, ",", ('"arguments"', '"parameters"'), ":", "{")
_ITEM_HEAD: tuple[_Step, ...] = ("{", '"name"', ":", _NAME, ",", '"parameters"', ":", "{")
_FIRST_ITEM_HEAD = ("[", *_ITEM_HEAD)
_NEXT_ITEM_HEAD = (",", *_ITEM_HEAD)
_NAMED_HEAD: tuple[_Step, ...] = ("{",)
_ARRAY_END: tuple[_Step, ...] = ("]",)


class _State(enum.Enum):
    PLAIN = "plain"  # content only (``none``, or a forced answer that is not a call)
    TEXT = "text"  # auto: content, until a <tool_call> tag
    HEAD = "head"  # a call's head, not yet complete
    ARGUMENTS = "arguments"  # a call's arguments object, released as it comes
    TAIL = "tail"  # the rest of a call after its arguments: the call object's closing and the end tag
    NEXT = "next"  # required: after a call, the next one or the array's end
    WHOLE = "whole"  # a call written another way: held and read whole
    END = "end"  # after a forced answer: only whitespace belongs here; anything else is content


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class _JsonScan:
    """Finds where a JSON object or array ends in text that arrives in pieces (strings and escapes tracked),
    from inside ``depth`` open objects or arrays."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self.done = False
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int:
        """How much of ``text`` belongs to the value: all of it while the value goes on, less where it ends."""
        for i, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    return i + 1
        return len(text)


class ToolCallReader:
    """Reads one choice's reply into content and tool calls, delta by delta (:meth:`push`, then
    :meth:`finish`), for the request's ``tool_choice``. Not thread-safe: one reader per choice."""

    def __init__(self, body: ChatCompletionRequest) -> None:
        choice = body.effective_tool_choice
        self._named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        self._mode: str = "named" if isinstance(choice, NamedToolChoice) else choice
        self._state = {"none": _State.PLAIN, "auto": _State.TEXT}.get(self._mode, _State.HEAD)
        self._head = _NAMED_HEAD if self._named is not None else _FIRST_ITEM_HEAD
        self._buffer = ""
        self._scan = _JsonScan()
        self._calls: list[_Call] = []
        self._cut = False

    @property
    def calls(self) -> list[ToolCall]:
        """The calls read so far (the last one's arguments as far as they are released)."""
        return [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments="".join(c.arguments))) for c in self._calls
        ]

    @property
    def cut(self) -> bool:
        """Whether the reply ended inside a call's arguments (the token limit cut it, or they are not JSON)."""
        return self._cut

    def push(self, text: str) -> list[Piece]:
        """The pieces that ``text``, the reply's next delta, releases."""
        self._buffer += text
        out: list[Piece] = []
        while self._advance(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        """The pieces left at the end of the reply: what was held back, read as the reply ended."""
        out: list[Piece] = []
        rest, self._buffer = self._buffer, ""
        state, self._state = self._state, _State.PLAIN
        if state is _State.ARGUMENTS:  # cut inside the arguments: what was held back is theirs
            self._arguments(out, rest)
            self._cut = True
        elif state in (_State.PLAIN, _State.TEXT) or (state is _State.END and rest.strip(_WS)):
            _content(out, rest)
        elif state in (_State.HEAD, _State.WHOLE, _State.NEXT) and self._mode == "auto":
            call = _hermes_call(rest)  # the reply ended inside a block (EOS before the end tag)
            if call is not None:
                self._whole_call(out, call)
            else:
                _content(out, TOOL_CALL_OPEN + rest)
        elif state in (_State.HEAD, _State.WHOLE, _State.NEXT) and self._mode == "required":
            calls = _required_calls(rest if not self._calls else _rest_of_array(rest))
            for name, arguments in calls:
                self._whole_call(out, (name, arguments))
            if not calls:
                _content(out, rest)
        elif state is _State.HEAD:  # named: an answer that is not an object
            _content(out, rest)
        return out

    def _advance(self, out: list[Piece]) -> bool:
        """Reads what the buffer allows in the current state; True where the state changed (read on)."""
        match self._state:
            case _State.PLAIN:
                _content(out, self._buffer)
                self._buffer = ""
                return False
            case _State.TEXT:
                return self._read_text(out)
            case _State.HEAD:
                return self._read_head(out)
            case _State.ARGUMENTS:
                return self._read_arguments(out)
            case _State.TAIL:
                return self._read_tail()
            case _State.NEXT:
                return self._read_next(out)
            case _State.WHOLE:
                return self._read_block(out) if self._mode == "auto" else False
            case _State.END:
                return False

    def _read_text(self, out: list[Piece]) -> bool:
        start = self._buffer.find(TOOL_CALL_OPEN)
        if start < 0:
            keep = _partial_tag(self._buffer, TOOL_CALL_OPEN)
            _content(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        _content(out, self._buffer[:start])
        self._buffer = self._buffer[start + len(TOOL_CALL_OPEN) :]
        self._state, self._head = _State.HEAD, _HERMES_HEAD
        return True

    def _read_head(self, out: list[Piece]) -> bool:
        close = self._buffer.find(TOOL_CALL_CLOSE) if self._mode == "auto" else -1
        head = _match(self._buffer if close < 0 else self._buffer[:close], self._head)
        if isinstance(head, tuple):
            self._start_call(out, self._named or head[0] or "", head[1])
            return True
        if head and close < 0:
            return False  # the head may still come
        if self._mode == "named":  # not an object: the answer is content
            self._state = _State.PLAIN
        else:
            self._state = _State.WHOLE
        return True

    def _start_call(self, out: list[Piece], name: str, start: int) -> None:
        """A call whose head is read: its first delta, and its arguments read from ``start`` (their ``{``)."""
        self._open_call(out, name)
        self._buffer = self._buffer[start:]
        self._scan = _JsonScan()
        self._state = _State.ARGUMENTS

    def _read_arguments(self, out: list[Piece]) -> bool:
        close, limit = -1, len(self._buffer)
        if self._mode == "auto":
            close = self._buffer.find(TOOL_CALL_CLOSE)
            limit = close if close >= 0 else len(self._buffer) - _partial_tag(self._buffer, TOOL_CALL_CLOSE)
        used = self._scan.feed(self._buffer[:limit])
        self._arguments(out, self._buffer[:used])
        self._buffer = self._buffer[used:]
        if self._scan.done:
            self._state = _State.END if self._mode == "named" else _State.TAIL
            self._scan = _JsonScan(depth=1)  # required's tail: the rest of the call object
            return True
        if close >= 0:  # the block ends inside the arguments (not JSON): the call keeps what it has
            self._buffer = self._buffer[len(TOOL_CALL_CLOSE) :]
            self._state = _State.TEXT
            return True
        return False

    def _read_tail(self) -> bool:
        """Drops the call's markup after its arguments: up to the end tag (auto), or the call object's end."""
        if self._mode == "required":
            self._buffer = self._buffer[self._scan.feed(self._buffer) :]
            if self._scan.done:
                self._state = _State.NEXT
            return self._scan.done
        close = self._buffer.find(TOOL_CALL_CLOSE)
        if close < 0:
            self._buffer = self._buffer[len(self._buffer) - _partial_tag(self._buffer, TOOL_CALL_CLOSE) :]
            return False
        self._buffer = self._buffer[close + len(TOOL_CALL_CLOSE) :]
        self._state = _State.TEXT
        return True

    def _read_next(self, out: list[Piece]) -> bool:
        end = _match(self._buffer, _ARRAY_END)
        if isinstance(end, tuple):
            self._buffer = self._buffer[end[1] + 1 :]
            self._state = _State.END
            return True
        head = _match(self._buffer, _NEXT_ITEM_HEAD)
        if isinstance(head, tuple):
            self._start_call(out, head[0] or "", head[1])
            return True
        if not end and not head:
            self._state = _State.WHOLE
        return False

    def _read_block(self, out: list[Piece]) -> bool:
        """A Hermes block that does not begin like a call: read whole at its end tag."""
        close = self._buffer.find(TOOL_CALL_CLOSE)
        if close < 0:
            return False
        block, self._buffer = self._buffer[:close], self._buffer[close + len(TOOL_CALL_CLOSE) :]
        call = _hermes_call(block)
        if call is None:  # not a call after all: it stays text
            _content(out, f"{TOOL_CALL_OPEN}{block}{TOOL_CALL_CLOSE}")
        else:
            self._whole_call(out, call)
        self._state = _State.TEXT
        return True

    def _open_call(self, out: list[Piece], name: str) -> None:
        call = _Call(id=f"call_{uuid.uuid4().hex[:24]}", name=name[:64])
        self._calls.append(call)
        out.append(
            ToolCallDelta(
                index=len(self._calls) - 1,
                id=call.id,
                type="function",
                function=FunctionCallDelta(name=call.name, arguments=""),
            )
        )

    def _arguments(self, out: list[Piece], text: str) -> None:
        """The current call's next arguments fragment (merged into this push's last delta of that call)."""
        if not text:
            return
        index = len(self._calls) - 1
        self._calls[index].arguments.append(text)
        last = out[-1] if out else None
        if isinstance(last, ToolCallDelta) and last.index == index and last.function.name is None:
            last.function.arguments += text
        else:
            out.append(ToolCallDelta(index=index, function=FunctionCallDelta(arguments=text)))

    def _whole_call(self, out: list[Piece], call: tuple[str, Any]) -> None:
        name, arguments = call
        self._open_call(out, name)
        self._arguments(out, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def _content(out: list[Piece], text: str) -> None:
    if not text:
        return
    if out and isinstance(out[-1], str):
        out[-1] += text
    else:
        out.append(text)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _match(text: str, steps: tuple[_Step, ...]) -> tuple[str | None, int] | bool:
    """Matches the start of ``text`` (JSON whitespace allowed before each step) against a call's head: the
    name read and where the last step begins once it matches; True while more text could still make it match,
    False once it cannot."""
    pos, name = 0, None
    start = 0
    for step in steps:
        while pos < len(text) and text[pos] in _WS:
            pos += 1
        if pos == len(text):
            return True
        start = pos
        if step is _NAME:
            end = _string_end(text, pos)
            if isinstance(end, bool):
                return end
            try:
                name = json.loads(text[pos:end])
            except ValueError:
                return False
            if not name:
                return False
            pos = end
            continue
        options = (step,) if isinstance(step, str) else step
        matched = next((o for o in options if text.startswith(o, pos)), None)
        if matched is None:
            return any(o.startswith(text[pos:]) for o in options)
        pos += len(matched)
    return name, start


def _string_end(text: str, pos: int) -> int | bool:
    """Where the JSON string that begins at ``pos`` ends (past its closing quote); True while it is open,
    False if no string begins there."""
    if text[pos] != '"':
        return False
    escaped = False
    for i in range(pos + 1, len(text)):
        if escaped:
            escaped = False
        elif text[i] == "\\":
            escaped = True
        elif text[i] == '"':
            return i + 1
    return True


def _hermes_call(block: str) -> tuple[str, Any] | None:
    """The name and arguments of the call written in a ``<tool_call>`` block, None if it is not one."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return value["name"], arguments if arguments is not None else {}


def _rest_of_array(text: str) -> str:
    """A ``required`` answer's items after its first calls (``, {...}]``) as an array of their own."""
    rest = text.lstrip(_WS)
    return "[" + rest[1:] if rest.startswith(",") else ""


def _required_calls(text: str) -> list[tuple[str, Any]]:
    """The calls of a ``required`` answer (a JSON array of ``{"name", "parameters"}``); none if it is cut."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if not isinstance(value, list):
        return []
    items = [v for v in value if isinstance(v, dict) and isinstance(v.get("name"), str) and v["name"]]
    return [(v["name"], v.get("parameters", {})) for v in items]
