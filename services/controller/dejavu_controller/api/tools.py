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
* ``dejavu_controller.api.tool_calls`` reads a reply, as it streams, into content and OpenAI ``tool_calls``.
"""

from __future__ import annotations

import json
from typing import Any

from dejavu_common.messages import GrammarSpec

from .schemas.chat import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ChatCompletionRequest,
    NamedToolChoice,
    Tool,
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
