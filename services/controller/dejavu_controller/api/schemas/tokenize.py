"""``POST /tokenize`` and ``POST /detokenize``: request and response shapes as vLLM's (unknown fields are
ignored, as vLLM and the OpenAI endpoints here ignore them)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .chat import ChatMessage


class TokenizeCompletionRequest(BaseModel):
    """A text to tokenize as a completion prompt is."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(None, description="If given, the served model's id.")
    prompt: str
    add_special_tokens: bool = Field(True, description="The model's BOS/EOS convention applies (as for a prompt).")
    return_token_strs: bool = Field(False, description="Also return each token's text.")


class TokenizeChatRequest(BaseModel):
    """A conversation to tokenize as a chat prompt is (the model's chat template)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(None, description="If given, the served model's id.")
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = Field(True, description="End with the assistant turn's opening, as chat does.")
    add_special_tokens: bool = Field(False, description="Accepted for vLLM's shape; the template places them.")
    return_token_strs: bool = Field(False, description="Also return each token's text.")


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(None, description="If given, the served model's id.")
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
