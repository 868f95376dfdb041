"""From a validated HTTP request to the backend's :class:`GenerationRequest`: model, prompt and
length checks that need the tokenizer or the settings (field ranges are the schemas' job)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import anyio

from dejavu_common import logs
from dejavu_common.messages import GrammarSpec, SamplingSpec
from dejavu_common.tokenizer import TokenizerError
from dejavu_controller.backend import GenerationRequest

from .errors import InvalidRequestError, NotFoundError
from .schemas.common import SamplingRequest
from .state import Gateway
from .structured import grammar_of


def new_request_id(prefix: str) -> str:
    """An OpenAI-style id (``cmpl-…``, ``chatcmpl-…``), also used as the backend's request id; every line the
    task serving it logs from now on names it."""
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    logs.bind_request(request_id)
    return request_id


def check_model(gateway: Gateway, model: str) -> None:
    """404 unless ``model`` is the served model's id."""
    if model != gateway.model_name:
        raise NotFoundError(f"the model `{model}` does not exist", param="model", code="model_not_found")


def check_prompt_chars(gateway: Gateway, chars: int, param: str) -> None:
    """400 if a prompt text is longer than ``controller.max_prompt_chars``: checked before tokenizing,
    so an oversized prompt costs no tokenizer time."""
    limit = gateway.settings.controller.max_prompt_chars
    if chars > limit:
        raise InvalidRequestError(
            f"the prompt has {chars} characters; this server accepts at most {limit}",
            param=param,
            code="context_length_exceeded",
        )


async def encode_text(gateway: Gateway, text: str, param: str) -> list[int]:
    """Token ids of a prompt text, bounded in length first and tokenized on a worker thread (a long
    prompt never stalls the event loop, and so never the other requests' streams)."""
    check_prompt_chars(gateway, len(text), param)
    return await anyio.to_thread.run_sync(gateway.tokenizer.encode, text)


async def encode_chat(
    gateway: Gateway,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a conversation (with ``tools`` for a template that renders them) under the model's chat
    template, bounded and tokenized like :func:`encode_text`; 400 (``param`` ``messages``) if the template
    rejects the conversation."""
    chars = sum(len(m["content"]) for m in messages) + (len(json.dumps(tools)) if tools else 0)
    check_prompt_chars(gateway, chars, "messages")
    try:
        apply = gateway.tokenizer.apply_chat_template
        return await anyio.to_thread.run_sync(apply, list(messages), add_generation_prompt, tools)
    except TokenizerError as exc:  # e.g. the template rejects the order of roles
        raise InvalidRequestError(str(exc), param="messages") from exc


def check_token_ids(gateway: Gateway, token_ids: Sequence[int], param: str) -> None:
    """400 unless every id is in the vocabulary (an out-of-range id would fail a worker's embedding)."""
    vocab = gateway.tokenizer.vocab_size
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)


def admit(
    gateway: Gateway,
    request_id: str,
    prompt_ids: Sequence[int],
    body: SamplingRequest,
    max_tokens: int | None,
    prompt_param: str,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    tool_grammar: GrammarSpec | None = None,
) -> GenerationRequest:
    """Check the prompt against the context and build the backend request.

    ``max_tokens`` None means "whatever the context leaves"; ``logprobs`` and ``prompt_logprobs``: how many
    likeliest tokens' log probabilities to report per generated and per prompt position (None: none);
    ``tool_grammar``: the grammar that enforces a tool call (``tools.tool_grammar``).
    Raises :class:`InvalidRequestError` for an empty prompt, when prompt + ``max_tokens`` exceeds
    ``settings.engine.max_context``, or for sampling values out of bounds together.
    """
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty", param=prompt_param)
    context = gateway.max_context
    room = context - len(prompt_ids)
    wanted = room if max_tokens is None else max_tokens
    if room < 1 or wanted > room:
        raise InvalidRequestError(
            f"this model's maximum context length is {context} tokens, but {len(prompt_ids) + max(wanted, 1)} "
            f"were requested ({len(prompt_ids)} in the prompt, {max(wanted, 1)} to generate)",
            param=prompt_param if room < 1 else "max_tokens",
            code="context_length_exceeded",
        )
    sampling = sampling_spec(gateway, body, wanted, logprobs, prompt_logprobs, tool_grammar)
    return GenerationRequest(request_id, tuple(prompt_ids), sampling, stop=body.stop_strings)


def sampling_spec(
    gateway: Gateway,
    body: SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    tool_grammar: GrammarSpec | None = None,
) -> SamplingSpec:
    """The request's :class:`SamplingSpec`; 400 for token ids outside the vocabulary (``logit_bias``,
    ``stop_token_ids``), for values the spec refuses together (``min_tokens`` above ``max_tokens``) and for
    a structured output asked together with a forced tool call (one grammar per request)."""
    grammar = grammar_of(body)
    if grammar is not None and tool_grammar is not None:
        raise InvalidRequestError(
            "`tool_choice` required or a named function cannot go with a structured output", param="tool_choice"
        )
    bias = body.bias_pairs
    check_token_ids(gateway, [t for t, _ in bias], "logit_bias")
    check_token_ids(gateway, body.stop_token_ids or (), "stop_token_ids")
    if body.min_tokens > max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens"
        )
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),  # -1 is vLLM's spelling of "off"
        min_p=body.min_p,
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=bias,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        raw_logprobs=body.logprobs_mode == "raw",
        grammar=grammar if grammar is not None else tool_grammar,
    )
