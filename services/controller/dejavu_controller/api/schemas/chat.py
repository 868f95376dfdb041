"""``POST /v1/chat/completions``: request, response and stream chunk."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, ValidationInfo, field_validator, model_serializer

from dejavu_common.messages import MAX_LOGPROBS

from .common import SamplingRequest, Usage, _unsupported

Role = Literal["system", "developer", "user", "assistant"]
# Bounds on a conversation's shape (its text is bounded by `controller.max_prompt_chars`, its bytes by
# `controller.max_body_bytes`): a body of many tiny messages or parts costs memory and template time.
MAX_MESSAGES = 2048  # OpenAI's limit
MAX_CONTENT_PARTS = 256


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Role
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _bounded_parts(cls, value: str | list[TextPart]) -> str | list[TextPart]:
        if isinstance(value, list) and len(value) > MAX_CONTENT_PARTS:
            raise ValueError(f"a message may have at most {MAX_CONTENT_PARTS} content parts")
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_template_message(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict a chat template expects (``developer`` is a system message)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name of max_tokens; wins if both.")
    logprobs: bool | None = Field(None, description="Return the log probability of each generated token.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="With `logprobs`: also those of this many likeliest tokens."
    )
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("`tools` are not supported by this server")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        return _unsupported("tool_choice", value, (None, "none"))

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise ValueError("only `response_format` {'type': 'text'} is supported")
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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


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
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    """A message delta; unset fields are left out (the final chunk's delta is ``{}``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice] = Field(default_factory=list)
    usage: Usage | None = None
    system_fingerprint: str | None = None
