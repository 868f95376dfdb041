"""Tool calling on chat: the prompt that offers the tools, the grammar that enforces a call, and the reading of
a reply into OpenAI ``tool_calls``.

* The tools reach the model through its chat template where the template renders them (it reads ``tools``);
  otherwise a system message lists them and asks for calls in the Hermes format (a JSON object
  ``{"name", "arguments"}`` between ``<tool_call>`` tags), as :meth:`ChatMessage.as_template_message` writes
  earlier calls and tool answers. ``tool_choice: none`` offers no tools.
* ``required`` and a named function are enforced with a grammar (vLLM's shapes): a named function's reply is
  its arguments object, valid against its ``parameters`` schema; ``required``'s is a JSON array of
  ``{"name", "parameters"}`` objects, each valid against its function's schema (one only without
  ``parallel_tool_calls``). ``auto`` is free text, read for Hermes ``<tool_call>`` blocks.
* :class:`ToolCallReader` reads one choice's text as it streams: content is released as it comes (held back
  only where it could begin a ``<tool_call>`` tag), and each call is released whole once it is complete.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from dejavu_common.messages import GrammarSpec

from .schemas.chat import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ChatCompletionRequest,
    FunctionCall,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from .structured import json_schema_spec

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def template_messages(body: ChatCompletionRequest, template_takes_tools: bool) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it; with the tools described in a system message where
    they are offered and the template does not render them itself."""
    messages = [m.as_template_message(template_takes_tools) for m in body.messages]
    tools = offered_tools(body)
    if tools is None or template_takes_tools:
        return messages
    text = _tools_prompt(tools)
    if messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def offered_tools(body: ChatCompletionRequest) -> list[Tool] | None:
    """The tools the prompt offers: none with ``tool_choice: none``."""
    return body.tools if body.tools and body.effective_tool_choice != "none" else None


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The ``tools`` variable of a template that renders tools (transformers passes OpenAI's definitions)."""
    tools = offered_tools(body)
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def _tools_prompt(tools: list[Tool]) -> str:
    definitions = "\n".join(json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False) for tool in tools)
    return (
        "You can call functions. Their definitions, as JSON:\n<tools>\n"
        f"{definitions}\n</tools>\n"
        'To call a function, reply with a JSON object {"name": <function name>, "arguments": <arguments object>} '
        f"between {TOOL_CALL_OPEN} and {TOOL_CALL_CLOSE}, one such block per call."
    )


def tool_grammar(body: ChatCompletionRequest) -> GrammarSpec | None:
    """The grammar that enforces ``required`` or a named function (None for ``auto`` and ``none``); 400
    (``tools``) for a ``parameters`` schema that cannot be enforced."""
    choice = body.effective_tool_choice
    tools = {tool.function.name: tool for tool in body.tools or ()}
    if isinstance(choice, NamedToolChoice):
        return json_schema_spec(_parameters(tools[choice.function.name]), "tools")
    if choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": _parameters(tool)},
            "required": ["name", "parameters"],
        }
        for name, tool in tools.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return json_schema_spec(schema, "tools")


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _ANY_OBJECT


def _call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=text))


class ToolCallReader:
    """Reads one choice's reply into content and tool calls, delta by delta (:meth:`push`, then
    :meth:`finish`), for the request's ``tool_choice``."""

    def __init__(self, body: ChatCompletionRequest) -> None:
        choice = body.effective_tool_choice
        self._named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        self._mode = "named" if self._named is not None else choice
        self._buffer = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content to release now and the calls completed by ``text``."""
        if self._mode == "none":
            return text, []
        self._buffer += text
        if self._mode != "auto":
            return "", []  # a forced reply is one JSON value: read whole at the end
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(TOOL_CALL_OPEN)
                if start < 0:
                    keep = _partial_tag(self._buffer)
                    content.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(TOOL_CALL_OPEN) :]
                self._in_call = True
            else:
                end = self._buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    break
                block, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_CLOSE) :]
                self._in_call = False
                call = _hermes_call(block)
                if call is None:  # not a call after all: it stays text
                    content.append(f"{TOOL_CALL_OPEN}{block}{TOOL_CALL_CLOSE}")
                else:
                    calls.append(call)
        self.calls.extend(calls)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end of the reply: content, and the calls it completes."""
        rest, self._buffer = self._buffer, ""
        calls: list[ToolCall] = []
        if self._mode == "named":
            assert self._named is not None
            calls = [_call(self._named, rest.strip())] if _is_object(rest) else []
        elif self._mode == "required":
            calls = _required_calls(rest)
        elif self._mode == "auto" and self._in_call:  # the reply ended inside a block (EOS before the close tag)
            call = _hermes_call(rest)
            calls = [call] if call is not None else []
            rest = "" if call is not None else f"{TOOL_CALL_OPEN}{rest}"
        if calls and self._mode != "auto":
            rest = ""
        self.calls.extend(calls)
        return rest, calls


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of ``text`` that begins the ``<tool_call>`` tag."""
    for size in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _hermes_call(block: str) -> ToolCall | None:
    """The call written in a ``<tool_call>`` block, None if it is not one."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return _call(value["name"][:64], arguments if arguments is not None else {})


def _required_calls(text: str) -> list[ToolCall]:
    """The calls of a ``required`` reply (a JSON array of ``{"name", "parameters"}``); none if it is cut."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if not isinstance(value, list):
        return []
    items = [v for v in value if isinstance(v, dict) and isinstance(v.get("name"), str) and v["name"]]
    return [_call(v["name"][:64], v.get("parameters", {})) for v in items]
