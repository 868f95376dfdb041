"""``POST /v1/completions``: request, response and stream chunk (OpenAI's legacy completions API)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from dejavu_common.messages import MAX_LOGPROBS

from .common import SamplingRequest, Usage, _unsupported

# A prompt as text or as token ids; OpenAI also accepts a batch (a list of either) of which we take one.
Prompt = str | list[int] | list[str] | list[list[int]]

# OpenAI's default for this endpoint (chat defaults to the remaining context instead).
DEFAULT_MAX_TOKENS = 16


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = Field(None, ge=0, description="Tokens to generate at most; 0 (with `echo`): none.")
    echo: bool = Field(False, description="Return the prompt before the completion (with its logprobs, if asked).")
    suffix: str | None = None
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Log probabilities of each token and of this many likeliest ones."
    )
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

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _unsupported("suffix", value, (None, ""))

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        return _unsupported("best_of", value, (None, 1))


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy log probabilities: per token, its text, log probability (None for the first prompt
    token, which nothing predicts), the likeliest tokens' (and the chosen one's) and its offset in the text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: CompletionLogprobs | None = None
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
