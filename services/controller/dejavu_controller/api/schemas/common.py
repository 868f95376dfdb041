"""Schemas shared by the OpenAI endpoints: errors, usage, and the sampling fields of a request."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from dejavu_common.messages import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS

MAX_STOP_STRINGS = 4  # OpenAI's limit
# Choices of one request (``n``): each runs as its own sequence, so the bound keeps one request's share small.
MAX_CHOICES = 16
# Extra stop tokens of one request (every sampled token is checked against them).
MAX_STOP_TOKEN_IDS = 64
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


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema (``schema``) the output must satisfy. Every output is held
    to it, ``strict`` or not (with xgrammar's strict reading: no properties the schema does not list)."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free ``text``, any JSON object (``json_object``), or JSON that satisfies
    ``json_schema.schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="Extension: drop tokens below min_p x the best one's probability."
    )
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description="Extension: token ids that end the sequence (kept in it)."
    )
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices to generate, each its own sequence.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=2.0, description="Extension (HF's): over the prompt and generated tokens; 1 = off."
    )
    min_tokens: int = Field(0, ge=0, description="Extension: tokens generated before an EOS or stop token may end it.")
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100]; -100 bans, +100 forces the token."
    )
    logprobs_mode: Literal["processed", "raw"] = Field(
        "processed", description="Extension: log probabilities after logit_bias/min_tokens/penalties, or the model's."
    )
    user: str | None = None
    ignore_eos: bool = Field(
        False, description="Extension (vLLM's): keep generating past the model's EOS tokens; `stop` still applies."
    )
    response_format: ResponseFormat | None = Field(
        None, description="`json_object` or `json_schema`: the output is JSON (satisfying the schema)."
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="Extension (vLLM's): a JSON schema to satisfy.")
    guided_regex: str | None = Field(None, description="Extension (vLLM's): a regular expression to match in full.")
    guided_choice: list[str] | None = Field(None, description="Extension (vLLM's): the output is one of these.")
    guided_grammar: str | None = Field(None, description="vLLM's EBNF grammar: not supported (400).")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="Extension (vLLM's): one of `json`, `regex`, `choice`, `json_object`."
    )

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"`logit_bias` may hold at most {MAX_LOGIT_BIAS} tokens")
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"`logit_bias` keys are token ids, got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"`logit_bias` values must be in [-100, 100], got {bias} for token {key}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value and any(t < 0 for t in value):
            raise ValueError("`stop_token_ids` must be token ids (>= 0)")
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

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token id, bias)`` pairs in id order (what ``SamplingSpec`` holds)."""
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))
