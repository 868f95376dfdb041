"""Schemas shared by the OpenAI endpoints: errors, usage, and the sampling fields of a request."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_STOP_STRINGS = 4  # OpenAI's limit
# Every generated token is matched against every stop string: bound their length, not just their count.
MAX_STOP_CHARS = 256


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class StreamOptions(BaseModel):
    include_usage: bool = False


def _unsupported(name: str, value: Any, allowed: tuple[Any, ...]) -> Any:
    """Accept ``value`` only if it is one of the no-op ``allowed`` values."""
    if value not in allowed:
        raise ValueError(f"`{name}` is not supported by this server (allowed: {', '.join(map(repr, allowed))})")
    return value


class SamplingRequest(BaseModel):
    """Fields common to ``/v1/completions`` and ``/v1/chat/completions``.

    Unknown fields are ignored (clients send vendor extensions); known OpenAI features this server
    does not implement are accepted only at their no-op values and rejected (400) otherwise.
    """

    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="Model id, as listed by GET /v1/models.")
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="Extension: sample among the k most likely tokens; 0 or -1 = off.")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = Field(
        False, description="Extension (vLLM's): keep generating past the model's EOS tokens; `stop` still applies."
    )

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int) -> int:
        return _unsupported("n", value, (1,))

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float, info: ValidationInfo) -> float:
        return _unsupported(str(info.field_name), value, (0.0,))

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("`logit_bias` is not supported by this server")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else (value or [])
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
        if any(s == "" for s in strings):
            raise ValueError("stop sequences must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in strings):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters long")
        return value

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("`stream_options` is only allowed when `stream` is true")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage
