"""``POST /v1/completions``: request, response and stream chunk (OpenAI's legacy completions API)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from .common import SamplingRequest, Usage, _unsupported

# A prompt as text or as token ids; OpenAI also accepts a batch (a list of either) of which we take one.
Prompt = str | list[int] | list[str] | list[list[int]]

# OpenAI's default for this endpoint (chat defaults to the remaining context instead).
DEFAULT_MAX_TOKENS = 16


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Prompt) -> str | list[int]:
        """Normalize to one prompt: a string or a list of token ids."""
        if isinstance(value, str):
            return value
        if value and all(isinstance(item, int) for item in value):
            if any(item < 0 for item in value):  # type: ignore[operator]
                raise ValueError("token ids must be >= 0")
            return value  # type: ignore[return-value]
        if len(value) != 1:
            raise ValueError("exactly one prompt per request is supported (got a batch or an empty list)")
        return cls._one_prompt(value[0])  # type: ignore[arg-type]

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        return _unsupported("echo", value, (False,))

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _unsupported("suffix", value, (None, ""))

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        return _unsupported("logprobs", value, (None,))

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        return _unsupported("best_of", value, (None, 1))


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChunk(CompletionResponse):
    """A stream chunk has the response's shape; ``usage`` is set only on the final usage chunk."""

    choices: list[CompletionChoice] = Field(default_factory=list)
