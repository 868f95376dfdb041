"""``POST /v1/chat/completions``: request, response and stream chunk."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from dejavu_common.messages import MAX_LOGPROBS

from .common import SamplingRequest, Usage

Role = Literal["system", "developer", "user", "assistant", "tool"]
# Bounds on a conversation's shape (its text is bounded by `controller.max_prompt_chars`, its bytes by
# `controller.max_body_bytes`): a body of many tiny messages or parts costs memory and template time.
MAX_MESSAGES = 2048  # OpenAI's limit
MAX_CONTENT_PARTS = 256
MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOL_CALLS = 128  # of one assistant message
FinishReasonName = Literal["stop", "length", "tool_calls"]
# How a tool call is written in a prompt and in a reply where the chat template has no tool support (the
# Hermes format, which Qwen2.5's and Hermes' templates use too): a JSON object {"name", "arguments"} between
# these tags. A tool's answer goes back as a `tool` message between the response tags.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(description="The arguments as a JSON object's text.")


class ToolCall(BaseModel):
    """A call of a function: in an assistant message of the conversation, and in a reply."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_call(self) -> dict[str, Any]:
        """The call as chat templates read it: OpenAI's shape with the arguments parsed (transformers')."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    """A turn of the conversation: ``content`` may be left out (null) by an assistant turn that calls tools;
    a ``tool`` turn answers the call ``tool_call_id``."""

    role: Role
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = None
    content: str | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("tool_calls")
    @classmethod
    def _calls_of_the_assistant(cls, value: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if value and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry `tool_calls`")
        return value

    @field_validator("content")
    @classmethod
    def _bounded_parts(cls, value: str | list[TextPart] | None, info: ValidationInfo) -> str | list[TextPart] | None:
        if value is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("a message needs `content` (only an assistant message with `tool_calls` may omit it)")
        if isinstance(value, list) and len(value) > MAX_CONTENT_PARTS:
            raise ValueError(f"a message may have at most {MAX_CONTENT_PARTS} content parts")
        return value

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def as_template_message(self, template_takes_tools: bool = False) -> dict[str, Any]:
        """The dict a chat template expects (``developer`` is a system message). Tool calls and tool answers
        go as they are to a template that renders tools (``tool_calls`` with parsed arguments,
        ``tool_call_id``), and otherwise into the text, in the Hermes format."""
        role = "system" if self.role == "developer" else self.role
        calls = [call.template_call() for call in self.tool_calls or ()]
        if template_takes_tools:
            message: dict[str, Any] = {"role": role, "content": self.text}
            if calls:
                message["tool_calls"] = calls
            if self.tool_call_id is not None:
                message["tool_call_id"] = self.tool_call_id
            return message
        text = self.text
        if calls:
            written = [json.dumps(call["function"], ensure_ascii=False) for call in calls]
            text = "\n".join([text, *(f"{TOOL_CALL_OPEN}\n{w}\n{TOOL_CALL_CLOSE}" for w in written)]).lstrip("\n")
        if role == "tool":
            text = f"{TOOL_RESPONSE_OPEN}\n{text}\n{TOOL_RESPONSE_CLOSE}"
        return {"role": role, "content": text}


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments object.")
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name of max_tokens; wins if both.")
    logprobs: bool | None = Field(None, description="Return the log probability of each generated token.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="With `logprobs`: also those of this many likeliest tokens."
    )
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: `auto` with tools, `none` without."
    )
    parallel_tool_calls: bool = True

    @field_validator("tools")
    @classmethod
    def _distinct_functions(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [tool.function.name for tool in value or ()]
        if len(set(names)) != len(names):
            raise ValueError("`tools` must name distinct functions")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, value: Any, info: ValidationInfo) -> Any:
        names = [tool.function.name for tool in info.data.get("tools") or ()]
        if value in ("auto", "required") or isinstance(value, NamedToolChoice):
            if not names:
                raise ValueError("`tool_choice` other than none needs `tools`")
            if isinstance(value, NamedToolChoice) and value.function.name not in names:
                raise ValueError(f"`tool_choice` names the function {value.function.name!r}, which `tools` lacks")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("`top_logprobs` needs `logprobs` set to true")
        return value

    @property
    def logprobs_top(self) -> int | None:
        """How many likeliest tokens' log probabilities each position reports (None: no log probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def effective_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice:
        """``tool_choice``, or its default: ``auto`` where there are tools, ``none`` otherwise."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_when_any(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReasonName


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class FunctionCallDelta(BaseModel):
    """A call's name (its first delta only) and the next fragment of its arguments' text; unset fields are
    left out."""

    name: str | None = None
    arguments: str = ""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ToolCallDelta(BaseModel):
    """A streamed tool call's delta (``index``: the call's among the choice's calls), as OpenAI streams it: the
    first carries ``id``, ``type`` and the name with empty arguments, the next ones only the ``index`` and the
    next fragment of the arguments; unset fields are left out."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatDelta(BaseModel):
    """A message delta; unset fields are left out (the final chunk's delta is ``{}``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice] = Field(default_factory=list)
    usage: Usage | None = None
    system_fingerprint: str | None = None
