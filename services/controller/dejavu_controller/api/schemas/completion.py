"""``POST /v1/completions``: request, response and stream chunk (OpenAI's legacy completions API)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from dejavu_common.messages import MAX_LOGPROBS

from .common import MAX_CHOICES, SamplingRequest, Usage, _unsupported

# A prompt as text or as token ids, or a batch of prompts: a list of either (OpenAI's and vLLM's batch form).
Prompt = str | list[int] | list[str] | list[list[int]]
# One prompt of a request: text or token ids.
OnePrompt = str | list[int]

# OpenAI's default for this endpoint (chat defaults to the remaining context instead).
DEFAULT_MAX_TOKENS = 16


def prompt_param(index: int, count: int) -> str:
    """The name of prompt ``index`` of ``count`` in errors: ``prompt`` alone, ``prompt[3]`` in a batch."""
    return "prompt" if count == 1 else f"prompt[{index}]"


def prompts_of(value: Prompt) -> list[OnePrompt]:
    """The prompts ``value`` holds, in order: itself when it is one prompt (text or token ids), else its items."""
    if isinstance(value, str) or (value and all(isinstance(item, int) for item in value)):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


class CompletionRequest(SamplingRequest):
    prompt: Prompt = Field(
        description=f"A text, a list of token ids, or a batch: a list of either ({MAX_CHOICES} choices at most "
        "in all, prompts x `n`)."
    )
    max_tokens: int | None = Field(None, ge=0, description="Tokens to generate at most; 0 (with `echo`): none.")
    echo: bool = Field(False, description="Return the prompt before the completion (with its logprobs, if asked).")
    suffix: str | None = None
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Log probabilities of each token and of this many likeliest ones."
    )
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompts(cls, value: Prompt, info: ValidationInfo) -> Prompt:
        """At least one prompt, token ids >= 0, and at most ``MAX_CHOICES`` choices in all (prompts x ``n``;
        ``n`` is validated before, as a field of the base class)."""
        prompts = prompts_of(value)
        if not prompts:
            raise ValueError("at least one prompt is required (got an empty list)")
        for index, prompt in enumerate(prompts):
            if not isinstance(prompt, str) and any(token < 0 for token in prompt):
                raise ValueError(f"token ids must be >= 0 (in {prompt_param(index, len(prompts))})")
        n = info.data.get("n", 1)
        if len(prompts) * n > MAX_CHOICES:
            raise ValueError(
                f"{len(prompts)} prompts with n = {n} make {len(prompts) * n} choices; at most {MAX_CHOICES} "
                "are allowed per request (prompts x n)"
            )
        return value

    @property
    def prompts(self) -> list[OnePrompt]:
        """The request's prompts in order (prompt ``i``'s choice ``j`` is choice ``i * n + j``)."""
        return prompts_of(self.prompt)

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
